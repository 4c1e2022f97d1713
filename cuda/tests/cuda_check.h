// Assertions of the standalone CUDA tests and tools: print where and why,
// then exit 1. CHECK(cond) or CHECK(cond, "format", args...);
// CUDA_CHECK(call) checks a CUDA runtime call's status.
#ifndef MOE_JAX_CUDA_TESTS_CUDA_CHECK_H_
#define MOE_JAX_CUDA_TESTS_CUDA_CHECK_H_

#include <cstdio>
#include <cstdlib>

#include <cuda_runtime_api.h>

#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, "" __VA_ARGS__);                                    \
      std::fprintf(stderr, "\n");                                              \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

#define CUDA_CHECK(expr)                                                       \
  do {                                                                         \
    cudaError_t err_ = (expr);                                                 \
    if (err_ != cudaSuccess) {                                                 \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(err_));                                  \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

#endif  // MOE_JAX_CUDA_TESTS_CUDA_CHECK_H_

// Host-side entry points of the pack and combine kernels.
//
// Plain C++ (no device code): included by the FFI handlers, the kernels and
// the standalone test. Each launcher enqueues exactly one kernel on `stream`
// (none when the output is empty), never allocates or synchronizes, and
// returns cudaGetLastError() after the launch. The launch configuration
// depends only on the sizes below; the vector width is chosen inside the
// kernel from the sizes and the pointers' alignment.
#ifndef MOE_JAX_CUDA_PACK_COMBINE_H_
#define MOE_JAX_CUDA_PACK_COMBINE_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "xla_ffi/float_type.h"

namespace moe_jax::cuda {

// f32 / bf16 / f16: the element types of the CPU kernels too.
using ElemType = ::moe_jax::FloatType;

inline int ElemBytes(ElemType t) { return t == ElemType::kF32 ? 4 : 2; }

// moe_jax_pack: cap_buf[P, capacity, H] and spill_buf[P, spill_capacity, H].
struct PackArgs {
  const void* x;               // [T, H], row_bytes per row
  const int32_t* sorted_slots;  // [N]
  const int32_t* send_offsets;  // [P]
  const int32_t* send_counts;   // [P]
  void* cap_buf;
  void* spill_buf;
  int64_t num_tokens;  // T
  int64_t num_slots;   // N
  int64_t num_ranks;   // P
  int64_t row_bytes;   // H * itemsize
  int64_t top_k;
  int64_t start;
  int64_t capacity;
  int64_t spill_capacity;
};

cudaError_t LaunchPack(const PackArgs& args, cudaStream_t stream);

// moe_jax_combine: out[T, H] from cap_ret[P, C, H] and spill_ret[P, S, H].
struct CombineArgs {
  const void* cap_ret;
  const void* spill_ret;
  const int32_t* dest;   // [N]
  const int32_t* pos;    // [N]
  const float* weights;  // [T, k]
  void* out;
  int64_t num_tokens;  // T
  int64_t hidden;      // H
  int64_t top_k;       // k
  int64_t num_ranks;   // P
  int64_t cap_rows;    // C
  int64_t spill_rows;  // S
  int64_t start;
};

cudaError_t LaunchCombine(const CombineArgs& args, ElemType in_type,
                          ElemType out_type, cudaStream_t stream);

}  // namespace moe_jax::cuda

#endif  // MOE_JAX_CUDA_PACK_COMBINE_H_

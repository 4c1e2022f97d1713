// Tuning benchmark of the grouped GEMM's tile configurations at the Mixtral
// expert shape (bf16; H = 4096, F = 14336, 8 experts, group sizes skewed as
// in benchmarks/expert_ffn_bench.py): for each configuration, the swiglu
// (gate/up with the fused epilogue), gate_up (the same GEMM, plain output)
// and down GEMMs at 32, 512, 2048 and 8192 rows,
// median time of 5 runs of 10 launches (CUDA events), TFLOP/s, weight
// bytes streamed per second, and whether the output equals configuration
// 0's bit for bit (row invariance across configurations).
//
//   build/gpu/cuda/grouped_gemm_tune [CSV_PATH]
//
// Built with -DMOE_JAX_GROUPED_GEMM_TUNE=ON (each configuration is its own
// translation unit).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "grouped_gemm.h"
#include "grouped_gemm_tune.h"
#include "tests/cuda_check.h"

namespace gg = moe_jax::cuda::grouped_gemm;
using moe_jax::cuda::GemmElem;
using moe_jax::cuda::GroupedGemmArgs;
using moe_jax::cuda::GroupedGemmOp;

namespace {

__global__ void FillRandom(uint16_t* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float u = (static_cast<float>(h & 0xFFFFFF) / 16777216.0f) * 2.0f - 1.0f;
    const float f = (u == 0.0f ? 0.5f : u) * scale;
    uint32_t bits;
    memcpy(&bits, &f, 4);
    p[i] = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
  }
}

std::vector<gg::TuneEntry> Configs() {
  return {gg::TuneConfigAt<0>(), gg::TuneConfigAt<1>(), gg::TuneConfigAt<2>(),
          gg::TuneConfigAt<3>(), gg::TuneConfigAt<4>(), gg::TuneConfigAt<5>(),
          gg::TuneConfigAt<6>(), gg::TuneConfigAt<7>(), gg::TuneConfigAt<8>()};
}

std::vector<int32_t> SkewedSizes(int64_t rows, int groups, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<double> share(groups);
  for (int e = 0; e < groups; ++e) share[e] = std::exp(-1.0 * e / groups);
  std::discrete_distribution<int> pick(share.begin(), share.end());
  std::vector<int32_t> sizes(groups, 0);
  for (int64_t r = 0; r < rows; ++r) ++sizes[pick(rng)];
  return sizes;
}

}  // namespace

int main(int argc, char** argv) {
  int device = 0, sm_count = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (std::string err = moe_jax::cuda::GroupedGemmDeviceError(); !err.empty()) {
    std::printf("grouped_gemm_tune: %s\n", err.c_str());
    return 0;
  }
  CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  FILE* csv = argc > 1 ? std::fopen(argv[1], "w") : nullptr;
  if (csv) std::fprintf(csv, "config,op,rows,us,tflops,weight_gbps,bitwise_equal_to_config0\n");

  const int64_t H = 4096, F = 14336, G = 8, max_rows = 8192;
  struct Shape {
    GroupedGemmOp op;
    const char* name;
    int64_t k, n, out_cols;
  };
  // gate_up: the swiglu GEMM with the plain TMA epilogue writing [M, 2F],
  // which shows what the fused epilogue costs or saves.
  const Shape shapes[] = {{GroupedGemmOp::kForwardSwiGLU, "swiglu", H, 2 * F, F},
                          {GroupedGemmOp::kForward, "gate_up", H, 2 * F, 2 * F},
                          {GroupedGemmOp::kForward, "down", F, H, H}};
  uint16_t *a, *b, *out, *ref;
  int32_t* sizes_d;
  void* ws;
  CUDA_CHECK(cudaMalloc(&a, max_rows * F * 2));
  CUDA_CHECK(cudaMalloc(&b, G * H * 2 * F * 2));
  CUDA_CHECK(cudaMalloc(&out, max_rows * 2 * F * 2));
  CUDA_CHECK(cudaMalloc(&ref, max_rows * 2 * F * 2));
  CUDA_CHECK(cudaMalloc(&sizes_d, G * 4));
  const size_t ws_bytes = moe_jax::cuda::GroupedGemmWorkspaceBytes(G);
  CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  FillRandom<<<1024, 256>>>(a, max_rows * F, 1, 1.0f);
  FillRandom<<<1024, 256>>>(b, G * H * 2 * F, 2, 0.02f);
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));

  const std::vector<gg::TuneEntry> configs = Configs();
  std::printf("%-36s %-7s %6s %10s %8s %11s %s\n", "config", "op", "rows", "us", "TFLOP/s",
              "weight GB/s", "bits == config 0");
  for (const Shape& s : shapes) {
    for (int64_t rows : {int64_t{32}, int64_t{512}, int64_t{2048}, max_rows}) {
      const std::vector<int32_t> sizes = SkewedSizes(rows, G, 7);
      CUDA_CHECK(cudaMemcpy(sizes_d, sizes.data(), G * 4, cudaMemcpyHostToDevice));
      int nonempty = 0;
      for (int32_t v : sizes) nonempty += v > 0;
      GroupedGemmArgs args;
      args.op = s.op;
      args.in_type = args.out_type = GemmElem::kBF16;
      args.a = a;
      args.b = b;
      args.group_sizes = sizes_d;
      args.rows = rows;
      args.k = s.k;
      args.n = s.n;
      args.groups = G;
      args.workspace = ws;
      args.workspace_bytes = ws_bytes;
      const size_t out_bytes = rows * s.out_cols * 2;
      for (size_t c = 0; c < configs.size(); ++c) {
        args.out = out;
        CUDA_CHECK(cudaMemset(out, 0xFF, out_bytes));
        std::string err = configs[c].run(args, nullptr, device, sm_count);
        if (!err.empty()) {
          std::printf("%-36s %-7s %6lld  error: %s\n", configs[c].name.c_str(), s.name,
                      (long long)rows, err.c_str());
          continue;
        }
        CUDA_CHECK(cudaDeviceSynchronize());
        if (c == 0) CUDA_CHECK(cudaMemcpy(ref, out, out_bytes, cudaMemcpyDeviceToDevice));
        std::vector<uint16_t> got(out_bytes / 2), want(out_bytes / 2);
        CUDA_CHECK(cudaMemcpy(got.data(), out, out_bytes, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(want.data(), ref, out_bytes, cudaMemcpyDeviceToHost));
        const bool same = got == want;
        std::vector<float> runs;
        for (int rep = 0; rep < 5; ++rep) {
          CUDA_CHECK(cudaEventRecord(start));
          for (int i = 0; i < 10; ++i) configs[c].run(args, nullptr, device, sm_count);
          CUDA_CHECK(cudaEventRecord(stop));
          CUDA_CHECK(cudaEventSynchronize(stop));
          float ms = 0;
          CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
          runs.push_back(ms / 10);
        }
        std::sort(runs.begin(), runs.end());
        const double us = runs[runs.size() / 2] * 1e3;
        const double tflops = 2.0 * rows * s.k * s.n / (us * 1e-6) / 1e12;
        const double gbps = double(nonempty) * s.k * s.n * 2 / (us * 1e-6) / 1e9;
        std::printf("%-36s %-7s %6lld %10.1f %8.1f %11.0f %s\n", configs[c].name.c_str(),
                    s.name, (long long)rows, us, tflops, gbps, same ? "yes" : "NO");
        if (csv) {
          std::fprintf(csv, "%s,%s,%lld,%.2f,%.2f,%.1f,%d\n", configs[c].name.c_str(), s.name,
                       (long long)rows, us, tflops, gbps, same ? 1 : 0);
        }
      }
    }
  }
  if (csv) std::fclose(csv);
  return 0;
}

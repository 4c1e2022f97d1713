// Launch geometry shared by the pack and combine launchers: 2-D blocks of
// kBlockThreads threads, blockDim.x threads per row (a power of two in
// [32, kBlockThreads]) and blockDim.y = kBlockThreads / blockDim.x rows per
// block. Everything is a function of the shapes only.
#ifndef MOE_JAX_CUDA_LAUNCH_SHAPE_H_
#define MOE_JAX_CUDA_LAUNCH_SHAPE_H_

#include <algorithm>
#include <cstdint>

namespace moe_jax::cuda {

inline constexpr int kBlockThreads = 256;
inline constexpr int kWarpThreads = 32;
inline constexpr int kMaxRowsPerBlock = kBlockThreads / kWarpThreads;
inline constexpr int64_t kMaxGridBlocks = 0x7fffffff;

struct LaunchShape {
  int threads_per_row;
  int rows_per_block;
  int blocks;
};

// `work_per_row` units of work per row, each thread taking up to
// `units_per_thread` of them per pass; kernels loop over rows if the grid is
// capped.
inline LaunchShape ShapeFor(int64_t rows, int64_t work_per_row,
                            int64_t units_per_thread) {
  const int64_t wanted = (work_per_row + units_per_thread - 1) / units_per_thread;
  int threads = kWarpThreads;
  while (threads < kBlockThreads && threads < wanted) threads *= 2;
  const int per_block = kBlockThreads / threads;
  const int64_t blocks = std::min<int64_t>((rows + per_block - 1) / per_block,
                                           kMaxGridBlocks);
  return {threads, per_block, static_cast<int>(blocks)};
}

}  // namespace moe_jax::cuda

#endif  // MOE_JAX_CUDA_LAUNCH_SHAPE_H_

// Host-side entry point of the moe_jax_row_matmul kernels.
//
// Plain C++ (no device code): included by the FFI handler and the kernels.
// The launcher enqueues exactly one kernel on `stream` (none when the output
// is empty), never allocates or synchronizes, and returns cudaGetLastError()
// after the launch. The launch shape is a function of (M, G, N) only: the
// kernel reads group_sizes on the device, so the launch can be captured into
// a CUDA graph and replayed with other group sizes.
#ifndef MOE_JAX_CUDA_ROW_MATMUL_H_
#define MOE_JAX_CUDA_ROW_MATMUL_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "pack_combine.h"

namespace moe_jax::cuda {

struct RowMatmulArgs {
  const void* x;               // [M, K], f32 or bf16
  const void* w;               // [G, K, N], dtype of x
  const int32_t* group_sizes;  // [G]
  float* out;                  // [M, N]
  int64_t rows;    // M
  int64_t depth;   // K
  int64_t cols;    // N
  int64_t groups;  // G
};

// Rows and columns of the output tile one block computes. A tile's rows lie
// in one group (its last tile may be partial) or in the zero tail. float32
// launches of at most kRowMatmulSkinnyMaxRows rows use 16-row tiles (more
// blocks, no work on 48 rows that do not exist); the others 64-row tiles.
// The tile shape never changes the arithmetic of a row.
inline constexpr int64_t kRowMatmulTileRows = 64;
inline constexpr int64_t kRowMatmulSkinnyTileRows = 16;
inline constexpr int64_t kRowMatmulSkinnyMaxRows = 128;
inline constexpr int64_t kRowMatmulTileCols = 64;

inline int64_t RowMatmulTileRowsFor(int64_t rows, ElemType in_type) {
  return in_type == ElemType::kF32 && rows <= kRowMatmulSkinnyMaxRows ? kRowMatmulSkinnyTileRows
                                                                      : kRowMatmulTileRows;
}

// Row tiles the grid provides: enough for any group sizes, since cutting M
// rows into G groups and the tail adds at most G partial tiles.
inline int64_t RowMatmulRowTiles(int64_t rows, int64_t groups, int64_t tile_rows) {
  return (rows + tile_rows - 1) / tile_rows + groups;
}

inline int64_t RowMatmulColTiles(int64_t cols) {
  return (cols + kRowMatmulTileCols - 1) / kRowMatmulTileCols;
}

// Largest grid the launcher accepts: row tiles on grid x, column tiles on
// grid y.
inline constexpr int64_t kRowMatmulMaxRowTiles = 0x7fffffff;
inline constexpr int64_t kRowMatmulMaxColTiles = 65535;

// `in_type` is kF32 or kBF16.
cudaError_t LaunchRowMatmul(const RowMatmulArgs& args, ElemType in_type,
                            cudaStream_t stream);

}  // namespace moe_jax::cuda

#endif  // MOE_JAX_CUDA_ROW_MATMUL_H_

// moe_jax_row_matmul: one launch of kThreads-thread blocks over a grid of
// RowMatmulRowTiles(M, G, tile rows) x RowMatmulColTiles(N) output tiles.
//
// Scheduling: the row tiles are numbered group by group (ceil(rows_g / R)
// tiles for group g, the last one partial, R the launch's tile rows), then
// the zero tail; each block's first warp finds its tile from group_sizes on
// the device (a warp-wide prefix sum over the groups), so the launch shape
// depends on (M, G, N) only. A tile never mixes groups: its rows past the
// group's end are computed from zeros and not stored.
//
// Pipelining (bfloat16 and 16-row float32 tiles): a block stages the next k
// chunk of its x rows and weights in registers while it multiplies the
// chunk in shared memory, so the loads of one chunk overlap the arithmetic
// of the previous one.
//
// Arithmetic, the same for every M and tile shape (which is what makes rows
// invariant):
//   float32: per output, acc = +0.0f, then for k = 0, 1, ..., K-1 in order
//     acc = fadd_rn(acc, fmul_rn(x[i, k], w[g, k, n])) (no FMA contraction),
//     the arithmetic of the CPU handler.
//   bfloat16 (sm_80 and newer): tensor cores through nvcuda::wmma, 16x16x16
//     steps with a float32 accumulator, over the k steps of 16 that hold
//     some k < K, in increasing order (the last one zero-padded). An MMA
//     output row depends on its A row and B only. Older GPUs run the float32
//     arithmetic on the exactly converted bfloat16 inputs.
#include <cstdint>

#include <cuda_bf16.h>
#include <mma.h>

#include "row_matmul.h"
#include "vec_access.cuh"

namespace moe_jax::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpThreads = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kTileCols = static_cast<int>(kRowMatmulTileCols);

enum class TileKind : int { kNone, kGroup, kTail };

// The output rows [row_begin, row_end) one row tile stores: rows of `group`
// (kGroup) or of the zero tail (kTail).
struct TileWork {
  TileKind kind;
  int64_t group;
  int64_t row_begin;
  int64_t row_end;
};

__device__ __forceinline__ int64_t WarpInclusiveSum(int64_t v) {
  const int lane = threadIdx.x % kWarpThreads;
#pragma unroll
  for (int d = 1; d < kWarpThreads; d *= 2) {
    const int64_t below = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += below;
  }
  return v;
}

// Run by one full warp: the rows of row tile `tile` (tiles of kTileRows
// rows). Groups own consecutive rows in order, max(group_sizes[g], 0) each,
// cut to [0, M).
template <int kTileRows>
__device__ TileWork FindTile(const RowMatmulArgs& a, int64_t tile) {
  const int lane = threadIdx.x % kWarpThreads;
  int64_t rows_before = 0;   // rows of the groups already scanned, <= M
  int64_t tiles_before = 0;  // their row tiles
  for (int64_t base = 0; base < a.groups; base += kWarpThreads) {
    const int64_t g = base + lane;
    const int64_t size =
        g < a.groups ? max(static_cast<int64_t>(__ldg(a.group_sizes + g)), int64_t{0}) : 0;
    const int64_t rows_incl = WarpInclusiveSum(size);
    const int64_t begin = min(rows_before + rows_incl - size, a.rows);
    const int64_t end = min(rows_before + rows_incl, a.rows);
    const int64_t tiles = (end - begin + kTileRows - 1) / kTileRows;
    const int64_t tiles_incl = WarpInclusiveSum(tiles);
    const int64_t first_tile = tiles_before + tiles_incl - tiles;
    const unsigned owner =
        __ballot_sync(kFullMask, tile >= first_tile && tile < first_tile + tiles);
    if (owner != 0) {
      const int src = __ffs(owner) - 1;
      const int64_t tile_in_group = tile - __shfl_sync(kFullMask, first_tile, src);
      const int64_t row_begin =
          __shfl_sync(kFullMask, begin, src) + tile_in_group * kTileRows;
      const int64_t group_end = __shfl_sync(kFullMask, end, src);
      return {TileKind::kGroup, base + src, row_begin,
              min(row_begin + kTileRows, group_end)};
    }
    rows_before =
        min(rows_before + __shfl_sync(kFullMask, rows_incl, kWarpThreads - 1), a.rows);
    tiles_before += __shfl_sync(kFullMask, tiles_incl, kWarpThreads - 1);
  }
  const int64_t tail_begin = rows_before + (tile - tiles_before) * kTileRows;
  if (tail_begin >= a.rows) return {TileKind::kNone, 0, 0, 0};
  return {TileKind::kTail, -1, tail_begin, min(tail_begin + kTileRows, a.rows)};
}

__device__ void ZeroTile(const RowMatmulArgs& a, const TileWork& t, int64_t col_begin) {
  const int64_t rows = t.row_end - t.row_begin;
  for (int64_t i = threadIdx.x; i < rows * kTileCols; i += kThreads) {
    const int64_t row = t.row_begin + i / kTileCols;
    const int64_t col = col_begin + i % kTileCols;
    if (col < a.cols) a.out[row * a.cols + col] = 0.0f;
  }
}

// Stores the tile's valid rows and columns from c_s ([tile rows][ld]).
__device__ void StoreTile(const RowMatmulArgs& a, const TileWork& t, int64_t col_begin,
                          const float* c_s, int ld) {
  const int64_t rows = t.row_end - t.row_begin;
  for (int64_t i = threadIdx.x; i < rows * kTileCols; i += kThreads) {
    const int r = static_cast<int>(i / kTileCols), c = static_cast<int>(i % kTileCols);
    const int64_t col = col_begin + c;
    if (col < a.cols) a.out[(t.row_begin + r) * a.cols + col] = c_s[r * ld + c];
  }
}

// CUDA cores, kTileRows x 64 tiles: each thread owns kTileRows / 16 x 4
// outputs (rows ty + 16 i, columns tx + 16 j) and adds their products over
// k in increasing order, multiply and add rounded separately. Skinny tiles
// prefetch the next, deeper chunk: their blocks are few when M is small, so
// each needs loads in flight; the 64-row tile's blocks fill the GPU, and it
// runs faster with the registers of four resident blocks per SM than with
// a prefetch.
template <typename In, int kTileRows>
struct CoreTile {
  static constexpr bool kPrefetch = kTileRows == static_cast<int>(kRowMatmulSkinnyTileRows);
  static constexpr int kDepth = kPrefetch ? 32 : 16;
  static constexpr int kLanes = 16;  // threads along rows and along columns
  static constexpr int kRowsPerThread = kTileRows / kLanes;
  static constexpr int kColsPerThread = kTileCols / kLanes;
  static constexpr int kStagedA = kTileRows * kDepth / kThreads;
  static constexpr int kStagedB = kDepth * kTileCols / kThreads;
  using S = typename In::Storage;

  // The chunk at k0 of this block's x rows and weight columns, zeros outside.
  struct Staged {
    float a[kStagedA];
    float b[kStagedB];

    __device__ void Load(const RowMatmulArgs& a_, const TileWork& t, const S* w,
                         int64_t k0, int64_t col_begin) {
      const S* x = static_cast<const S*>(a_.x);
#pragma unroll
      for (int i = 0; i < kStagedA; ++i) {
        const int e = threadIdx.x + i * kThreads;
        const int64_t row = t.row_begin + e / kDepth, k = k0 + e % kDepth;
        a[i] = row < t.row_end && k < a_.depth ? In::ToFloat(__ldg(x + row * a_.depth + k))
                                               : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kStagedB; ++i) {
        const int e = threadIdx.x + i * kThreads;
        const int64_t k = k0 + e / kTileCols, col = col_begin + e % kTileCols;
        b[i] = k < a_.depth && col < a_.cols ? In::ToFloat(__ldg(w + k * a_.cols + col)) : 0.0f;
      }
    }

    __device__ void Store(float (*a_s)[kTileRows + 1], float (*b_s)[kTileCols]) const {
#pragma unroll
      for (int i = 0; i < kStagedA; ++i) {
        const int e = threadIdx.x + i * kThreads;
        a_s[e % kDepth][e / kDepth] = a[i];
      }
#pragma unroll
      for (int i = 0; i < kStagedB; ++i) {
        const int e = threadIdx.x + i * kThreads;
        b_s[e / kTileCols][e % kTileCols] = b[i];
      }
    }
  };

  __device__ static void Run(const RowMatmulArgs& a, const TileWork& t, int64_t col_begin) {
    __shared__ float a_s[kDepth][kTileRows + 1];  // [k][row]; +1: no bank conflicts
    __shared__ float b_s[kDepth][kTileCols];      // [k][col]
    __shared__ float c_s[kTileRows * kTileCols];
    const S* w = static_cast<const S*>(a.w) + t.group * a.depth * a.cols;
    const int tx = threadIdx.x % kLanes, ty = threadIdx.x / kLanes;
    float acc[kRowsPerThread][kColsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) acc[i][j] = 0.0f;
    }
    Staged staged;
    if (kPrefetch) staged.Load(a, t, w, 0, col_begin);
    for (int64_t k0 = 0; k0 < a.depth; k0 += kDepth) {
      if (!kPrefetch) staged.Load(a, t, w, k0, col_begin);
      staged.Store(a_s, b_s);
      __syncthreads();
      if (kPrefetch && k0 + kDepth < a.depth) staged.Load(a, t, w, k0 + kDepth, col_begin);
      const int depth = static_cast<int>(min(int64_t{kDepth}, a.depth - k0));
      for (int kk = 0; kk < depth; ++kk) {
        float av[kRowsPerThread], bv[kColsPerThread];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) av[i] = a_s[kk][ty + kLanes * i];
#pragma unroll
        for (int j = 0; j < kColsPerThread; ++j) bv[j] = b_s[kk][tx + kLanes * j];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
          for (int j = 0; j < kColsPerThread; ++j) {
            acc[i][j] = __fadd_rn(acc[i][j], __fmul_rn(av[i], bv[j]));
          }
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) {
        c_s[(ty + kLanes * i) * kTileCols + tx + kLanes * j] = acc[i][j];
      }
    }
    __syncthreads();
    StoreTile(a, t, col_begin, c_s, kTileCols);
  }
};

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// Tensor cores, 64 x 64 tiles: 8 warps, each computing 16 rows x 32 columns
// of the tile as two 16x16 accumulators, over k steps of 16 in increasing
// order.
struct MmaTile {
  static constexpr int kTileRows = static_cast<int>(kRowMatmulTileRows);
  static constexpr int kDepth = 64;
  static constexpr int kMma = 16;
  static constexpr int kVec = 8;  // bf16 per 16-byte access
  // Row pitches (elements) keep every fragment 32-byte aligned, as wmma needs.
  static constexpr int kPitchA = kDepth + 8;
  static constexpr int kPitchB = kTileCols + 8;
  static constexpr int kPitchC = kTileCols + 4;
  static constexpr int kWarpCols = 32;
  static constexpr int kVecsA = kTileRows * kDepth / (kThreads * kVec);
  static constexpr int kVecsB = kDepth * kTileCols / (kThreads * kVec);
  static_assert(kVecsA * kThreads * kVec == kTileRows * kDepth, "whole A accesses");
  static_assert(kVecsB * kThreads * kVec == kDepth * kTileCols, "whole B accesses");

  using Bits = unsigned short;
  using Vec = Fragment<Bits, 16>;

  // The chunk at k0 of this block's x rows [kTileRows x kDepth] and weight
  // columns [kDepth x 64] in 8-element pieces, zeros outside. With `vec_*`
  // every piece is one aligned 16-byte load, else 8 scalar loads.
  struct Staged {
    Vec a[kVecsA];
    Vec b[kVecsB];

    __device__ static void LoadPiece(Vec& f, const Bits* src, int64_t valid, bool vec) {
      if (vec && valid >= kVec) {
        f.Load(src);
        return;
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) f.elem[e] = e < valid ? __ldg(src + e) : Bits{0};
    }

    __device__ void Load(const RowMatmulArgs& a_, const TileWork& t, const Bits* w,
                         int64_t k0, int64_t col_begin, bool vec_a, bool vec_b) {
      const Bits* x = static_cast<const Bits*>(a_.x);
#pragma unroll
      for (int i = 0; i < kVecsA; ++i) {
        const int p = threadIdx.x + i * kThreads;
        const int64_t row = t.row_begin + p / (kDepth / kVec), k = k0 + p % (kDepth / kVec) * kVec;
        const int64_t valid = row < t.row_end ? min(a_.depth - k, int64_t{kVec}) : 0;
        LoadPiece(a[i], x + row * a_.depth + k, valid, vec_a);
      }
#pragma unroll
      for (int i = 0; i < kVecsB; ++i) {
        const int p = threadIdx.x + i * kThreads;
        const int64_t k = k0 + p / (kTileCols / kVec), col = col_begin + p % (kTileCols / kVec) * kVec;
        const int64_t valid = k < a_.depth ? min(a_.cols - col, int64_t{kVec}) : 0;
        LoadPiece(b[i], w + k * a_.cols + col, valid, vec_b);
      }
    }

    __device__ void Store(Bits (*a_s)[kPitchA], Bits (*b_s)[kPitchB]) const {
#pragma unroll
      for (int i = 0; i < kVecsA; ++i) {
        const int p = threadIdx.x + i * kThreads;
        a[i].Store(&a_s[p / (kDepth / kVec)][p % (kDepth / kVec) * kVec]);
      }
#pragma unroll
      for (int i = 0; i < kVecsB; ++i) {
        const int p = threadIdx.x + i * kThreads;
        b[i].Store(&b_s[p / (kTileCols / kVec)][p % (kTileCols / kVec) * kVec]);
      }
    }
  };

  __device__ static void Run(const RowMatmulArgs& a, const TileWork& t, int64_t col_begin) {
    namespace wmma = nvcuda::wmma;
    __shared__ __align__(128) Bits a_s[kTileRows][kPitchA];
    __shared__ __align__(128) Bits b_s[kDepth][kPitchB];
    __shared__ __align__(128) float c_s[kTileRows * kPitchC];
    const Bits* w = static_cast<const Bits*>(a.w) + t.group * a.depth * a.cols;
    // 16-byte accesses when every row start is 16-byte aligned; uniform.
    const bool vec_a = a.depth % kVec == 0 && AlignedTo(a.x, 16);
    const bool vec_b = a.cols % kVec == 0 && AlignedTo(a.w, 16);
    const int warp = threadIdx.x / kWarpThreads;
    const int warp_row = warp % (kTileRows / kMma) * kMma;
    const int warp_col = warp / (kTileRows / kMma) * kWarpCols;

    wmma::fragment<wmma::accumulator, kMma, kMma, kMma, float> acc[kWarpCols / kMma];
#pragma unroll
    for (auto& f : acc) wmma::fill_fragment(f, 0.0f);
    Staged staged;
    staged.Load(a, t, w, 0, col_begin, vec_a, vec_b);
    for (int64_t k0 = 0; k0 < a.depth; k0 += kDepth) {
      staged.Store(a_s, b_s);
      __syncthreads();
      if (k0 + kDepth < a.depth) staged.Load(a, t, w, k0 + kDepth, col_begin, vec_a, vec_b);
      const int depth = static_cast<int>(min(int64_t{kDepth}, a.depth - k0));
      for (int kk = 0; kk < depth; kk += kMma) {
        wmma::fragment<wmma::matrix_a, kMma, kMma, kMma, __nv_bfloat16, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, reinterpret_cast<const __nv_bfloat16*>(&a_s[warp_row][kk]),
                               kPitchA);
#pragma unroll
        for (int j = 0; j < kWarpCols / kMma; ++j) {
          wmma::fragment<wmma::matrix_b, kMma, kMma, kMma, __nv_bfloat16, wmma::row_major> fb;
          wmma::load_matrix_sync(
              fb, reinterpret_cast<const __nv_bfloat16*>(&b_s[kk][warp_col + j * kMma]),
              kPitchB);
          wmma::mma_sync(acc[j], fa, fb, acc[j]);
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < kWarpCols / kMma; ++j) {
      wmma::store_matrix_sync(c_s + warp_row * kPitchC + warp_col + j * kMma, acc[j], kPitchC,
                              wmma::mem_row_major);
    }
    __syncthreads();
    StoreTile(a, t, col_begin, c_s, kPitchC);
  }
};
#else
struct MmaTile : CoreTile<BF16, static_cast<int>(kRowMatmulTileRows)> {};
#endif

template <typename Tile, int kTileRows>
__global__ void __launch_bounds__(kThreads) RowMatmulKernel(RowMatmulArgs a) {
  __shared__ TileWork work;
  if (threadIdx.x < kWarpThreads) {
    const TileWork found = FindTile<kTileRows>(a, blockIdx.x);
    if (threadIdx.x == 0) work = found;
  }
  __syncthreads();
  const TileWork t = work;
  const int64_t col_begin = static_cast<int64_t>(blockIdx.y) * kTileCols;
  if (t.kind == TileKind::kTail) {
    ZeroTile(a, t, col_begin);
  } else if (t.kind == TileKind::kGroup) {
    Tile::Run(a, t, col_begin);
  }
}

}  // namespace

cudaError_t LaunchRowMatmul(const RowMatmulArgs& args, ElemType in_type,
                            cudaStream_t stream) {
  if (args.rows <= 0 || args.cols <= 0) return cudaSuccess;
  if (in_type != ElemType::kF32 && in_type != ElemType::kBF16) return cudaErrorInvalidValue;
  const int64_t tile_rows = RowMatmulTileRowsFor(args.rows, in_type);
  const int64_t row_tiles = RowMatmulRowTiles(args.rows, args.groups, tile_rows);
  const int64_t col_tiles = RowMatmulColTiles(args.cols);
  if (row_tiles > kRowMatmulMaxRowTiles || col_tiles > kRowMatmulMaxColTiles) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  constexpr int kSkinny = static_cast<int>(kRowMatmulSkinnyTileRows);
  constexpr int kFull = static_cast<int>(kRowMatmulTileRows);
  if (in_type == ElemType::kBF16) {
    RowMatmulKernel<MmaTile, kFull><<<grid, kThreads, 0, stream>>>(args);
  } else if (tile_rows == kSkinny) {
    RowMatmulKernel<CoreTile<F32, kSkinny>, kSkinny><<<grid, kThreads, 0, stream>>>(args);
  } else {
    RowMatmulKernel<CoreTile<F32, kFull>, kFull><<<grid, kThreads, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace moe_jax::cuda

// moe_jax_row_matmul: one launch of kThreads-thread blocks over a grid of
// RowMatmulRowTiles(M, G) x RowMatmulColTiles(N) output tiles.
//
// Scheduling: the row tiles are numbered group by group (ceil(rows_g / 64)
// tiles for group g, the last one partial), then the zero tail; each block's
// first warp finds its tile from group_sizes on the device (a warp-wide
// prefix sum over the groups), so the launch shape depends on (M, G, N) only.
// A tile never mixes groups: its rows past the group's end are computed from
// zeros and not stored.
//
// Arithmetic, the same for every M (which is what makes rows invariant):
//   float32: per output, acc = +0.0f, then for k = 0, 1, ..., K-1 in order
//     acc = fadd_rn(acc, fmul_rn(x[i, k], w[g, k, n])) (no FMA contraction),
//     the arithmetic of the CPU handler.
//   bfloat16 (sm_80 and newer): tensor cores through nvcuda::wmma, 16x16x16
//     steps with a float32 accumulator, over k chunks of 16 in increasing
//     order (K zero-padded to a multiple of 16). An MMA output row depends on
//     its A row and B only. Older GPUs run the float32 arithmetic on the
//     exactly converted bfloat16 inputs.
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
constexpr int kTileRows = static_cast<int>(kRowMatmulTileRows);
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

// Run by one full warp: the rows of row tile `tile`. Groups own consecutive
// rows in order, max(group_sizes[g], 0) each, cut to [0, M).
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

// Stores the tile's valid rows and columns from c_s ([kTileRows][ld]).
__device__ void StoreTile(const RowMatmulArgs& a, const TileWork& t, int64_t col_begin,
                          const float* c_s, int ld) {
  const int64_t rows = t.row_end - t.row_begin;
  for (int64_t i = threadIdx.x; i < rows * kTileCols; i += kThreads) {
    const int r = static_cast<int>(i / kTileCols), c = static_cast<int>(i % kTileCols);
    const int64_t col = col_begin + c;
    if (col < a.cols) a.out[(t.row_begin + r) * a.cols + col] = c_s[r * ld + c];
  }
}

// CUDA cores: each thread owns 4 x 4 outputs (rows ty + 16 i, columns
// tx + 16 j) and adds their products over k in increasing order, multiply
// and add rounded separately.
template <typename In>
struct CoreTile {
  static constexpr int kDepth = 16;
  static constexpr int kPerThread = 4;
  static constexpr int kLanes = 16;  // threads along rows and along columns

  __device__ static void Run(const RowMatmulArgs& a, const TileWork& t, int64_t col_begin) {
    using S = typename In::Storage;
    __shared__ float a_s[kDepth][kTileRows + 1];  // [k][row]; +1: no bank conflicts
    __shared__ float b_s[kDepth][kTileCols];      // [k][col]
    __shared__ float c_s[kTileRows * kTileCols];
    const S* x = static_cast<const S*>(a.x);
    const S* w = static_cast<const S*>(a.w) + t.group * a.depth * a.cols;
    const int tx = threadIdx.x % kLanes, ty = threadIdx.x / kLanes;
    float acc[kPerThread][kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) acc[i][j] = 0.0f;
    }
    for (int64_t k0 = 0; k0 < a.depth; k0 += kDepth) {
#pragma unroll
      for (int i = 0; i < kTileRows * kDepth / kThreads; ++i) {
        const int e = threadIdx.x + i * kThreads;
        const int r = e / kDepth, kk = e % kDepth;
        const int64_t row = t.row_begin + r, k = k0 + kk;
        a_s[kk][r] = row < t.row_end && k < a.depth ? In::ToFloat(x[row * a.depth + k]) : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kDepth * kTileCols / kThreads; ++i) {
        const int e = threadIdx.x + i * kThreads;
        const int kk = e / kTileCols, c = e % kTileCols;
        const int64_t k = k0 + kk, col = col_begin + c;
        b_s[kk][c] = k < a.depth && col < a.cols ? In::ToFloat(w[k * a.cols + col]) : 0.0f;
      }
      __syncthreads();
      const int depth = static_cast<int>(min(int64_t{kDepth}, a.depth - k0));
      for (int kk = 0; kk < depth; ++kk) {
        float av[kPerThread], bv[kPerThread];
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) av[i] = a_s[kk][ty + kLanes * i];
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) bv[j] = b_s[kk][tx + kLanes * j];
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
          for (int j = 0; j < kPerThread; ++j) {
            acc[i][j] = __fadd_rn(acc[i][j], __fmul_rn(av[i], bv[j]));
          }
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        c_s[(ty + kLanes * i) * kTileCols + tx + kLanes * j] = acc[i][j];
      }
    }
    __syncthreads();
    StoreTile(a, t, col_begin, c_s, kTileCols);
  }
};

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// Tensor cores: 8 warps, each computing 16 rows x 32 columns of the tile as
// two 16x16 accumulators, over k steps of 16 in increasing order.
struct MmaTile {
  static constexpr int kDepth = 32;
  static constexpr int kMma = 16;
  static constexpr int kVec = 8;  // bf16 per 16-byte access
  // Row pitches (elements) keep every fragment 32-byte aligned, as wmma needs.
  static constexpr int kPitchA = kDepth + 8;
  static constexpr int kPitchB = kTileCols + 8;
  static constexpr int kPitchC = kTileCols + 4;
  static constexpr int kWarpCols = 32;

  using Bits = unsigned short;

  // x rows [row_begin, row_end) x k [k0, k0 + kDepth), zeros elsewhere.
  __device__ static void LoadA(const RowMatmulArgs& a, const TileWork& t, int64_t k0,
                               bool vec, Bits (*a_s)[kPitchA]) {
    const Bits* x = static_cast<const Bits*>(a.x);
    if (vec) {
      const int r = threadIdx.x / (kDepth / kVec), kk = threadIdx.x % (kDepth / kVec) * kVec;
      const int64_t row = t.row_begin + r, k = k0 + kk;
      Fragment<Bits, 16> f;
      if (row < t.row_end && k < a.depth) {
        f.Load(x + row * a.depth + k);
      } else {
        f.Zero();
      }
      f.Store(&a_s[r][kk]);
      return;
    }
#pragma unroll
    for (int i = 0; i < kTileRows * kDepth / kThreads; ++i) {
      const int e = threadIdx.x + i * kThreads;
      const int r = e / kDepth, kk = e % kDepth;
      const int64_t row = t.row_begin + r, k = k0 + kk;
      a_s[r][kk] = row < t.row_end && k < a.depth ? __ldg(x + row * a.depth + k) : Bits{0};
    }
  }

  // w_g rows k [k0, k0 + kDepth) x columns [col_begin, col_begin + 64).
  __device__ static void LoadB(const RowMatmulArgs& a, const Bits* w, int64_t k0,
                               int64_t col_begin, bool vec, Bits (*b_s)[kPitchB]) {
    if (vec) {
      const int kk = threadIdx.x / (kTileCols / kVec), c = threadIdx.x % (kTileCols / kVec) * kVec;
      const int64_t k = k0 + kk, col = col_begin + c;
      Fragment<Bits, 16> f;
      if (k < a.depth && col < a.cols) {
        f.Load(w + k * a.cols + col);
      } else {
        f.Zero();
      }
      f.Store(&b_s[kk][c]);
      return;
    }
#pragma unroll
    for (int i = 0; i < kDepth * kTileCols / kThreads; ++i) {
      const int e = threadIdx.x + i * kThreads;
      const int kk = e / kTileCols, c = e % kTileCols;
      const int64_t k = k0 + kk, col = col_begin + c;
      b_s[kk][c] = k < a.depth && col < a.cols ? __ldg(w + k * a.cols + col) : Bits{0};
    }
  }

  __device__ static void Run(const RowMatmulArgs& a, const TileWork& t, int64_t col_begin) {
    namespace wmma = nvcuda::wmma;
    static_assert(kTileRows * kDepth == kThreads * kVec, "one A access per thread");
    static_assert(kDepth * kTileCols == kThreads * kVec, "one B access per thread");
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
    for (int64_t k0 = 0; k0 < a.depth; k0 += kDepth) {
      LoadA(a, t, k0, vec_a, a_s);
      LoadB(a, w, k0, col_begin, vec_b, b_s);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kDepth; kk += kMma) {
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
struct MmaTile : CoreTile<BF16> {};
#endif

template <typename Tile>
__global__ void __launch_bounds__(kThreads) RowMatmulKernel(RowMatmulArgs a) {
  __shared__ TileWork work;
  if (threadIdx.x < kWarpThreads) {
    const TileWork found = FindTile(a, blockIdx.x);
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
  const int64_t row_tiles = RowMatmulRowTiles(args.rows, args.groups);
  const int64_t col_tiles = RowMatmulColTiles(args.cols);
  if (row_tiles > kRowMatmulMaxRowTiles || col_tiles > kRowMatmulMaxColTiles ||
      (in_type != ElemType::kF32 && in_type != ElemType::kBF16)) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  if (in_type == ElemType::kBF16) {
    RowMatmulKernel<MmaTile><<<grid, kThreads, 0, stream>>>(args);
  } else {
    RowMatmulKernel<CoreTile<F32>><<<grid, kThreads, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace moe_jax::cuda

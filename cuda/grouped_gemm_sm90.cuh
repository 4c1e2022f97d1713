// CUTLASS SM90 grouped GEMM kernels of moe_jax_grouped_matmul and the
// device-side preparation of their per-group problem shapes and pointers.
//
// Included only by the grouped_gemm_*.cu translation units, which
// instantiate RunGroupedGemm for their dtype; compiled for sm_90a.
//
// Row invariance: an output row of kForward / kForwardSwiGLU /
// kTransposedB is one tile row of one CTA's accumulators, summed over K in
// increasing K-tile order by warpgroup MMAs with float32 accumulators, with
// no split of K. The tile configuration depends on the op and dtype only,
// never on M or the group sizes, so a row's bits depend on its own input
// row and its group's weights alone.
#ifndef MOE_JAX_CUDA_GROUPED_GEMM_SM90_CUH_
#define MOE_JAX_CUDA_GROUPED_GEMM_SM90_CUH_

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "grouped_gemm.h"
#include "grouped_gemm_swiglu_epilogue.cuh"

namespace moe_jax::cuda::grouped_gemm {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using GroupShape = ProblemShape::UnderlyingProblemShape;

// A tile configuration: CTA tile M x N x K, cluster shape, and the
// warp-specialized schedule (ping-pong: one warpgroup per tile, two tiles in
// flight; cooperative: two warpgroups split one tile's rows).
template <int kTileM, int kTileN, int kTileK, int kClusterM, int kClusterN, bool kPingpong>
struct TileConfigT {
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using KernelSchedule =
      std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule =
      std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

// The configuration every op uses: cooperative on 128 x 256 x 64 tiles, no
// cluster, the fastest at every row count the tuning tool measures
// (cuda/tune/grouped_gemm_tune; docs/benchmarks/experts/grouped_gemm_tune_*.md).
// Every configuration with 64-deep K tiles gives the same bits.
using TileConfig = TileConfigT<128, 256, 64, 1, 1, false>;

template <class Elem>
inline constexpr int kAlign16B = 128 / cutlass::sizeof_bits<Elem>::value;

template <class ElementIn, class LayoutA, class LayoutB, class Config, int kEpilogueSmemBytes>
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA*,
    kAlign16B<ElementIn>, ElementIn, LayoutB*, kAlign16B<ElementIn>, float,
    typename Config::TileShape, typename Config::ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmemBytes>,
    typename Config::KernelSchedule>::CollectiveOp;

// D = A @ B per group, D row-major, stored by TMA; no source C.
template <class ElementIn, class ElementOut, class LayoutA, class LayoutB,
          class Config = TileConfig>
struct PlainSpec {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::TileShape,
      typename Config::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto, float,
      float, void, cutlass::layout::RowMajor*, kAlign16B<ElementOut>, ElementOut,
      cutlass::layout::RowMajor*, kAlign16B<ElementOut>, typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float, void, float>>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<
      ProblemShape,
      Mainloop<ElementIn, LayoutA, LayoutB, Config,
               static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Epilogue>;
  static constexpr bool kSwiGLU = false;
};

// out = silu(gate) * up per group from A @ B with B's columns in gate/up
// blocks (SwiGLUEpilogueArray), stored from registers.
template <class ElementIn, class Config = TileConfig, bool kPreciseSilu = false>
struct SwiGLUSpec {
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
      SwiGLUEpilogueArray<ElementIn, kPreciseSilu>>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<
      ProblemShape,
      Mainloop<ElementIn, cutlass::layout::RowMajor, cutlass::layout::RowMajor, Config, 0>,
      Epilogue>;
  static constexpr bool kSwiGLU = true;
};

// Where a group's operands start: base + start_row * row_step +
// group * group_step (bytes), and the leading dimension of each.
struct Operand {
  const char* base = nullptr;
  int64_t row_step = 0;
  int64_t group_step = 0;
  int64_t ld = 0;
};

struct PrepareParams {
  const int32_t* group_sizes = nullptr;
  int64_t groups = 0;
  int64_t rows = 0;  // M
  Operand a, b, d;
  // Problem of a group of n rows: (n, N, K) when !k_is_rows, else
  // (n > 0 ? M_fixed : 0, N, n).
  bool k_is_rows = false;
  int m_fixed = 0, n_fixed = 0, k_fixed = 0;
  // Zero fill: rows [total, M) of `zero_base` (row_bytes each) when
  // !k_is_rows; else the output blocks (group_bytes each) of empty groups.
  char* zero_base = nullptr;
  int64_t row_bytes = 0;
  int64_t group_bytes = 0;
  // Group records in the workspace.
  GroupShape* shapes = nullptr;
  const void** ptr_a = nullptr;
  const void** ptr_b = nullptr;
  void** ptr_d = nullptr;
  void* stride_a = nullptr;
  void* stride_b = nullptr;
  void* stride_d = nullptr;
};

template <class Stride>
__device__ __forceinline__ Stride PackedStride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_same_v<std::decay_t<decltype(cute::get<0>(s))>, int64_t>) {
    cute::get<0>(s) = ld;
  } else {
    cute::get<1>(s) = ld;
  }
  return s;
}

inline constexpr int kPrepareThreads = 256;

__device__ __forceinline__ int64_t RowsOf(const int32_t* sizes, int64_t g) {
  const int32_t n = sizes[g];
  return n > 0 ? n : 0;
}

__device__ __forceinline__ void ZeroBytes(char* p, int64_t bytes, int64_t first_chunk,
                                          int64_t chunk_stride) {
  // Every zeroed span starts and ends on a 16-byte boundary (rows and
  // blocks hold multiples of 8 16-bit or 4 32-bit elements).
  uint4* v = reinterpret_cast<uint4*>(p);
  const int64_t chunks = bytes / 16;
  for (int64_t i = first_chunk; i < chunks; i += chunk_stride) v[i] = make_uint4(0, 0, 0, 0);
}

// Block (0, 0) writes every group's record; all blocks zero the output that
// no group covers. Grid: (zero blocks, 1) for row outputs, (zero blocks, G)
// for weight gradients.
template <class StrideA, class StrideB, class StrideD>
__global__ void __launch_bounds__(kPrepareThreads) PrepareGroupsKernel(PrepareParams p) {
  using Scan = cub::BlockScan<int64_t, kPrepareThreads>;
  using Reduce = cub::BlockReduce<int64_t, kPrepareThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  __shared__ int64_t carry;

  if (blockIdx.x == 0 && blockIdx.y == 0) {
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int64_t first = 0; first < p.groups; first += kPrepareThreads) {
      const int64_t g = first + threadIdx.x;
      const int64_t n = g < p.groups ? RowsOf(p.group_sizes, g) : 0;
      int64_t before = 0, chunk_total = 0;
      Scan(tmp.scan).ExclusiveSum(n, before, chunk_total);
      const int64_t base = carry;
      if (g < p.groups) {
        const int64_t start = min(base + before, p.rows);
        const int64_t rows = min(n, p.rows - start);
        const int m = p.k_is_rows ? (rows > 0 ? p.m_fixed : 0) : static_cast<int>(rows);
        const int k = p.k_is_rows ? static_cast<int>(rows) : p.k_fixed;
        p.shapes[g] = GroupShape{m, p.n_fixed, k};
        p.ptr_a[g] = p.a.base + start * p.a.row_step + g * p.a.group_step;
        p.ptr_b[g] = p.b.base + start * p.b.row_step + g * p.b.group_step;
        p.ptr_d[g] = const_cast<char*>(p.d.base) + start * p.d.row_step + g * p.d.group_step;
        static_cast<StrideA*>(p.stride_a)[g] = PackedStride<StrideA>(p.a.ld);
        static_cast<StrideB*>(p.stride_b)[g] = PackedStride<StrideB>(p.b.ld);
        static_cast<StrideD*>(p.stride_d)[g] = PackedStride<StrideD>(p.d.ld);
      }
      __syncthreads();
      if (threadIdx.x == 0) carry = base + chunk_total;
      __syncthreads();
    }
  }

  const int64_t chunk_stride = static_cast<int64_t>(gridDim.x) * kPrepareThreads;
  const int64_t first_chunk = static_cast<int64_t>(blockIdx.x) * kPrepareThreads + threadIdx.x;
  if (p.k_is_rows) {
    const int64_t g = blockIdx.y;
    if (RowsOf(p.group_sizes, g) == 0) {
      ZeroBytes(p.zero_base + g * p.group_bytes, p.group_bytes, first_chunk, chunk_stride);
    }
    return;
  }
  int64_t partial = 0;
  for (int64_t g = threadIdx.x; g < p.groups; g += kPrepareThreads) {
    partial += RowsOf(p.group_sizes, g);
  }
  __shared__ int64_t total;
  const int64_t sum = Reduce(tmp.reduce).Sum(partial);
  if (threadIdx.x == 0) total = min(sum, p.rows);
  __syncthreads();
  ZeroBytes(p.zero_base + total * p.row_bytes, (p.rows - total) * p.row_bytes, first_chunk,
            chunk_stride);
}

// The operands' geometry for one op, in bytes and elements.
inline PrepareParams PrepareFor(const GroupedGemmArgs& args, size_t in_bytes, size_t out_bytes) {
  PrepareParams p;
  p.group_sizes = args.group_sizes;
  p.groups = args.groups;
  p.rows = args.rows;
  const int64_t K = args.k, N = args.n;
  const char* a = static_cast<const char*>(args.a);
  const char* b = static_cast<const char*>(args.b);
  const char* d = static_cast<const char*>(args.out);
  const int64_t ib = static_cast<int64_t>(in_bytes), ob = static_cast<int64_t>(out_bytes);
  switch (args.op) {
    case GroupedGemmOp::kForward:
    case GroupedGemmOp::kForwardSwiGLU: {
      const int64_t out_cols = args.op == GroupedGemmOp::kForward ? N : N / 2;
      p.a = {a, K * ib, 0, K};
      p.b = {b, 0, K * N * ib, N};
      p.d = {d, out_cols * ob, 0, out_cols};
      p.m_fixed = 0;
      p.n_fixed = static_cast<int>(N);
      p.k_fixed = static_cast<int>(K);
      p.row_bytes = out_cols * ob;
      break;
    }
    case GroupedGemmOp::kTransposedB:
      p.a = {a, N * ib, 0, N};
      p.b = {b, 0, K * N * ib, N};
      p.d = {d, K * ob, 0, K};
      p.n_fixed = static_cast<int>(K);
      p.k_fixed = static_cast<int>(N);
      p.row_bytes = K * ob;
      break;
    case GroupedGemmOp::kWeightGrad:
      p.a = {a, K * ib, 0, K};
      p.b = {b, N * ib, 0, N};
      p.d = {d, 0, K * N * ob, N};
      p.k_is_rows = true;
      p.m_fixed = static_cast<int>(K);
      p.n_fixed = static_cast<int>(N);
      p.group_bytes = K * N * ob;
      break;
  }
  p.zero_base = const_cast<char*>(d);
  return p;
}

inline std::string CutlassError(const char* what, cutlass::Status status) {
  return std::string(what) + ": " + cutlassGetStatusString(status);
}

// Prepares the groups and runs Spec's kernel for `args` on `stream`.
template <class Spec, class ElementIn, class ElementOut>
std::string RunGroupedGemm(const GroupedGemmArgs& args, cudaStream_t stream, int device,
                           int sm_count) {
  using Kernel = typename Spec::Kernel;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  static_assert(sizeof(StrideA) <= 32 && sizeof(StrideB) <= 32 && sizeof(StrideD) <= 32);
  static_assert(sizeof(GroupShape) <= 16);

  const GroupedGemmWorkspace layout(args.groups);
  char* ws = static_cast<char*>(args.workspace);
  PrepareParams p = PrepareFor(args, sizeof(ElementIn), sizeof(ElementOut));
  p.shapes = reinterpret_cast<GroupShape*>(ws + layout.shapes);
  p.ptr_a = reinterpret_cast<const void**>(ws + layout.ptr_a);
  p.ptr_b = reinterpret_cast<const void**>(ws + layout.ptr_b);
  p.ptr_d = reinterpret_cast<void**>(ws + layout.ptr_d);
  p.stride_a = ws + layout.stride_a;
  p.stride_b = ws + layout.stride_b;
  p.stride_d = ws + layout.stride_d;

  // Weight gradients zero the blocks of empty groups (grid y = G);
  // row outputs the rows past the last group.
  const unsigned zero_blocks =
      p.k_is_rows ? static_cast<unsigned>(std::max<int64_t>(1, 2 * sm_count / args.groups))
                  : static_cast<unsigned>(sm_count);
  const dim3 prep_grid(zero_blocks, p.k_is_rows ? static_cast<unsigned>(args.groups) : 1u);
  PrepareGroupsKernel<StrideA, StrideB, StrideD><<<prep_grid, kPrepareThreads, 0, stream>>>(p);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return std::string("group preparation kernel: ") + cudaGetErrorString(err);
  }

  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  typename Gemm::Arguments gemm_args;
  gemm_args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  gemm_args.problem_shape = {static_cast<int>(args.groups), p.shapes, nullptr};
  gemm_args.mainloop.ptr_A = reinterpret_cast<const ElementIn**>(p.ptr_a);
  gemm_args.mainloop.dA = static_cast<StrideA*>(p.stride_a);
  gemm_args.mainloop.ptr_B = reinterpret_cast<const ElementIn**>(p.ptr_b);
  gemm_args.mainloop.dB = static_cast<StrideB*>(p.stride_b);
  if constexpr (Spec::kSwiGLU) {
    gemm_args.epilogue.ptr_D = reinterpret_cast<ElementOut**>(p.ptr_d);
    gemm_args.epilogue.out_cols = args.n / 2;
  } else {
    auto& fusion = gemm_args.epilogue.thread;
    fusion.alpha = 1.0f;
    fusion.beta = 0.0f;
    gemm_args.epilogue.ptr_C = nullptr;
    gemm_args.epilogue.dC = nullptr;
    gemm_args.epilogue.ptr_D = reinterpret_cast<ElementOut**>(p.ptr_d);
    gemm_args.epilogue.dD = static_cast<StrideD*>(p.stride_d);
  }
  gemm_args.hw_info = hw;

  Gemm gemm;
  if (cutlass::Status s = gemm.can_implement(gemm_args); s != cutlass::Status::kSuccess) {
    return CutlassError("CUTLASS can_implement", s);
  }
  if (Gemm::get_workspace_size(gemm_args) > layout.end - layout.cutlass) {
    return "CUTLASS workspace exceeds the reserved " +
           std::to_string(layout.end - layout.cutlass) + " bytes";
  }
  if (cutlass::Status s = gemm.initialize(gemm_args, ws + layout.cutlass, stream);
      s != cutlass::Status::kSuccess) {
    return CutlassError("CUTLASS initialize", s);
  }
  if (cutlass::Status s = gemm.run(stream); s != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaGetLastError();
    return CutlassError("CUTLASS run", s) + " (" + cudaGetErrorString(err) + ")";
  }
  return "";
}

}  // namespace moe_jax::cuda::grouped_gemm

#endif  // MOE_JAX_CUDA_GROUPED_GEMM_SM90_CUH_

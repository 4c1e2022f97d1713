// Epilogue of the fused SwiGLU grouped GEMM: h = a @ b[g] with b's 2F
// columns alternating blocks of kSwiGLUBlock gate and up columns, written
// as out[:, f] = silu(gate_f) * up_f in the input dtype.
//
// A collective epilogue for CUTLASS's SM90 ptr-array kernels (it plugs into
// Sm90TmaWarpSpecializedAdapter like the library's no-smem epilogue): each
// math thread reads its accumulators in registers and stores its outputs
// straight to global memory. In the warpgroup MMA accumulator layout a
// thread holds pairs of adjacent columns repeated every 8 columns, so the
// gate block of 8 columns and the up block that follows it sit in the same
// thread: value v of the fragment and value v + 4 (see SwiGLUFragment).
#ifndef MOE_JAX_CUDA_GROUPED_GEMM_SWIGLU_EPILOGUE_CUH_
#define MOE_JAX_CUDA_GROUPED_GEMM_SWIGLU_EPILOGUE_CUH_

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/numeric_conversion.h"

#include "grouped_gemm.h"

namespace moe_jax::cuda::grouped_gemm {

// Gate of output column pair p of a fragment sits at value 2p' of an
// 8-column block, its up partner 4 values later: the SM90 accumulator
// fragment's first mode is (2 adjacent columns, 2 rows 8 apart, N/8 column
// blocks), column-major.
struct SwiGLUFragment {
  static constexpr int kUpOffset = 4;
  static constexpr int kValuesPerBlock = 4;
};
static_assert(kSwiGLUBlock == 8, "the fragment walk assumes 8-column gate/up blocks");

// silu(g) = g / (1 + e^-g) with the fast exponential and division (two
// MUFU operations): the epilogue runs while the tensor cores wait, and IEEE
// division and expf cost several times as many instructions. Relative error
// a few float32 ulps, far below the bf16 rounding of the output; for
// g < -87, e^-g = inf and the result is -0.
template <bool kPrecise>
__device__ __forceinline__ float Silu(float g) {
  if constexpr (kPrecise) {
    return g / (1.0f + expf(-g));
  } else {
    return __fdividef(g, 1.0f + __expf(-g));
  }
}

template <class ElementD_, bool kPreciseSilu = false>
class SwiGLUEpilogueArray {
 public:
  using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementD = ElementD_;
  using ElementC = void;
  using ElementOutput = ElementD;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using InternalStrideC = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;
  using InternalStrideD = InternalStrideC;
  using StrideC = InternalStrideC*;
  using StrideD = InternalStrideD*;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  using ThreadEpilogueOp = void;  // the whole epilogue is operator() below

  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;

  struct Arguments {
    ElementD** ptr_D = nullptr;  // [G] row-major [M_g, F] outputs
    int64_t out_cols = 0;        // F (leading dimension of every output)
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.out_cols % kSwiGLUBlock == 0;
  }

  CUTLASS_HOST_DEVICE explicit SwiGLUEpilogueArray(Params const& params) : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    static_assert(is_static<BlockShapeMNK>::value, "static tile shape");
    constexpr int kTileN = size<1>(BlockShapeMNK{});
    static_assert(kTileN % (2 * kSwiGLUBlock) == 0, "tile N must hold whole gate/up block pairs");

    const int rows = get<0>(problem_shape_mnkl);  // M_g
    const int cols = get<1>(problem_shape_mnkl);  // 2F
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    ElementD* out = params_.ptr_D[l_coord];

    // Tile coordinates of every accumulator this thread holds.
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor tile_coords = make_identity_tensor(take<0, 2>(blk_shape_mnk));
    Tensor thr_coords = thr_mma.partition_C(tile_coords);  // (V, MMA_M, MMA_N)
    static_assert(is_static<FrgLayout>::value, "static accumulator layout");
    CUTE_STATIC_ASSERT_V(size(thr_coords) == size(accumulators));
    constexpr int kValues = size<0>(FrgLayout{});
    static_assert(kValues % (2 * SwiGLUFragment::kValuesPerBlock) == 0,
                  "fragment values must come in gate/up block pairs");

    const int row0 = m_coord * size<0>(BlockShapeMNK{});
    const int col0 = n_coord * kTileN;
    cutlass::NumericArrayConverter<ElementD, float, 2> to_out;
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < size<1>(accumulators); ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int nn = 0; nn < size<2>(accumulators); ++nn) {
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < kValues; v += 2) {
          // Gate values only: blocks 0, 2, 4, ... of 4 values each.
          if ((v / SwiGLUFragment::kValuesPerBlock) % 2 != 0) continue;
          const auto coord = thr_coords(v, mm, nn);
          const int row = row0 + get<0>(coord);
          const int col = col0 + get<1>(coord);  // even: a pair of adjacent gate columns
          if (row >= rows || col >= cols) continue;
          const int up = v + SwiGLUFragment::kUpOffset;
          cutlass::Array<float, 2> h;
          h[0] = Silu<kPreciseSilu>(accumulators(v, mm, nn)) * accumulators(up, mm, nn);
          h[1] = Silu<kPreciseSilu>(accumulators(v + 1, mm, nn)) * accumulators(up + 1, mm, nn);
          const int out_col = (col / (2 * kSwiGLUBlock)) * kSwiGLUBlock + col % kSwiGLUBlock;
          auto packed = to_out(h);
          *reinterpret_cast<cutlass::Array<ElementD, 2>*>(
              out + static_cast<int64_t>(row) * params_.out_cols + out_col) = packed;
        }
      }
    }
  }

 private:
  Params params_;
};

}  // namespace moe_jax::cuda::grouped_gemm

#endif  // MOE_JAX_CUDA_GROUPED_GEMM_SWIGLU_EPILOGUE_CUH_

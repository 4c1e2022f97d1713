// The grouped GEMM kernels of one input dtype and one half (forward or
// backward), compiled once per combination (cuda/CMakeLists.txt) so the four
// build in parallel:
//   MOE_JAX_GEMM_F16=0|1       bf16 or f16 inputs
//   MOE_JAX_GEMM_BACKWARD=0|1  kForward (bf16/f16 or f32 out) and
//                              kForwardSwiGLU, or kTransposedB and kWeightGrad
#include "grouped_gemm_kernels.cuh"
#include "grouped_gemm_sm90.cuh"

namespace moe_jax::cuda::grouped_gemm {
namespace {

#if MOE_JAX_GEMM_F16
using T = cutlass::half_t;
#else
using T = cutlass::bfloat16_t;
#endif
using Row = cutlass::layout::RowMajor;
using Col = cutlass::layout::ColumnMajor;

std::string Run(const GroupedGemmArgs& args, cudaStream_t stream, int device, int sm_count) {
#if MOE_JAX_GEMM_BACKWARD
  if (args.op == GroupedGemmOp::kWeightGrad) {
    return RunGroupedGemm<PlainSpec<T, T, Col, Row>, T, T>(args, stream, device, sm_count);
  }
  return RunGroupedGemm<PlainSpec<T, T, Row, Col>, T, T>(args, stream, device, sm_count);
#else
  if (args.op == GroupedGemmOp::kForwardSwiGLU) {
    return RunGroupedGemm<SwiGLUSpec<T>, T, T>(args, stream, device, sm_count);
  }
  if (args.out_type == GemmElem::kF32) {
    return RunGroupedGemm<PlainSpec<T, float, Row, Row>, T, float>(args, stream, device, sm_count);
  }
  return RunGroupedGemm<PlainSpec<T, T, Row, Row>, T, T>(args, stream, device, sm_count);
#endif
}

}  // namespace

template <>
RunFn KernelsFor<MOE_JAX_GEMM_F16 ? GemmElem::kF16 : GemmElem::kBF16, MOE_JAX_GEMM_BACKWARD>() {
  return &Run;
}

}  // namespace moe_jax::cuda::grouped_gemm

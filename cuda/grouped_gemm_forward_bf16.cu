// kForward (bf16 or f32 output) and kForwardSwiGLU kernels for bf16 inputs.
#include "grouped_gemm_kernels.cuh"
#include "grouped_gemm_sm90.cuh"

namespace moe_jax::cuda::grouped_gemm {

std::string RunForwardBF16(const GroupedGemmArgs& args, cudaStream_t stream, int device,
                          int sm_count) {
  using T = cutlass::bfloat16_t;
  using Row = cutlass::layout::RowMajor;
  if (args.op == GroupedGemmOp::kForwardSwiGLU) {
    return RunGroupedGemm<SwiGLUSpec<T>, T, T>(args, stream, device, sm_count);
  }
  if (args.out_type == GemmElem::kF32) {
    return RunGroupedGemm<PlainSpec<T, float, Row, Row>, T, float>(args, stream, device, sm_count);
  }
  return RunGroupedGemm<PlainSpec<T, T, Row, Row>, T, T>(args, stream, device, sm_count);
}

}  // namespace moe_jax::cuda::grouped_gemm

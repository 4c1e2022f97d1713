// kTransposedB (f16 output) and kWeightGrad (f32 output) kernels for f16 inputs.
#include "grouped_gemm_kernels.cuh"
#include "grouped_gemm_sm90.cuh"

namespace moe_jax::cuda::grouped_gemm {

std::string RunBackwardF16(const GroupedGemmArgs& args, cudaStream_t stream, int device,
                           int sm_count) {
  using T = cutlass::half_t;
  using Row = cutlass::layout::RowMajor;
  using Col = cutlass::layout::ColumnMajor;
  if (args.op == GroupedGemmOp::kWeightGrad) {
    return RunGroupedGemm<PlainSpec<T, float, Col, Row>, T, float>(args, stream, device, sm_count);
  }
  return RunGroupedGemm<PlainSpec<T, T, Row, Col>, T, T>(args, stream, device, sm_count);
}

}  // namespace moe_jax::cuda::grouped_gemm

// The per-dtype entry points the grouped_gemm_*.cu translation units
// define (one dtype each, so they compile in parallel).
#ifndef MOE_JAX_CUDA_GROUPED_GEMM_KERNELS_CUH_
#define MOE_JAX_CUDA_GROUPED_GEMM_KERNELS_CUH_

#include <string>

#include <cuda_runtime_api.h>

#include "grouped_gemm.h"

namespace moe_jax::cuda::grouped_gemm {

// kForward and kForwardSwiGLU.
std::string RunForwardBF16(const GroupedGemmArgs& args, cudaStream_t stream, int device,
                           int sm_count);
std::string RunForwardF16(const GroupedGemmArgs& args, cudaStream_t stream, int device,
                          int sm_count);
// kTransposedB and kWeightGrad.
std::string RunBackwardBF16(const GroupedGemmArgs& args, cudaStream_t stream, int device,
                            int sm_count);
std::string RunBackwardF16(const GroupedGemmArgs& args, cudaStream_t stream, int device,
                           int sm_count);

}  // namespace moe_jax::cuda::grouped_gemm

#endif  // MOE_JAX_CUDA_GROUPED_GEMM_KERNELS_CUH_

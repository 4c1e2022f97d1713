// The kernels' entry points, one per input dtype and half, each defined by a
// compilation of grouped_gemm_instance.cu.
#ifndef MOE_JAX_CUDA_GROUPED_GEMM_KERNELS_CUH_
#define MOE_JAX_CUDA_GROUPED_GEMM_KERNELS_CUH_

#include <string>

#include <cuda_runtime_api.h>

#include "grouped_gemm.h"

namespace moe_jax::cuda::grouped_gemm {

using RunFn = std::string (*)(const GroupedGemmArgs& args, cudaStream_t stream, int device,
                              int sm_count);

// kBackward false: kForward and kForwardSwiGLU; true: kTransposedB and
// kWeightGrad. kIn: kBF16 or kF16.
template <GemmElem kIn, bool kBackward>
RunFn KernelsFor();

}  // namespace moe_jax::cuda::grouped_gemm

#endif  // MOE_JAX_CUDA_GROUPED_GEMM_KERNELS_CUH_

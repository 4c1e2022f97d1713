// Tile configurations of the grouped GEMM compiled into the tuning
// benchmark (bf16 inputs and outputs; ops forward and swiglu).
#ifndef MOE_JAX_CUDA_TUNE_GROUPED_GEMM_TUNE_H_
#define MOE_JAX_CUDA_TUNE_GROUPED_GEMM_TUNE_H_

#include <string>

#include <cuda_runtime_api.h>

#include "grouped_gemm.h"

namespace moe_jax::cuda::grouped_gemm {

inline constexpr int kTuneConfigs = 9;

struct TuneEntry {
  std::string name;
  std::string (*run)(const GroupedGemmArgs&, cudaStream_t, int device, int sm_count);
};

// Defined by grouped_gemm_tune_config.cu compiled with MOE_JAX_TUNE_CONFIG=I.
template <int I>
TuneEntry TuneConfigAt();

}  // namespace moe_jax::cuda::grouped_gemm

#endif  // MOE_JAX_CUDA_TUNE_GROUPED_GEMM_TUNE_H_

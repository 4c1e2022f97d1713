// XLA FFI handlers of the single-GPU ops on the CUDA platform (see
// docs/design/custom_calls.md). The collectives declare theirs in
// nvlink_handlers.h, nccl_all_to_all.h and fast_staged_all_to_all.h.
#ifndef MOE_JAX_CUDA_HANDLERS_CUDA_H_
#define MOE_JAX_CUDA_HANDLERS_CUDA_H_

#include "xla/ffi/api/api.h"

// Registered as "moe_jax_pack" / "moe_jax_combine" for platform "CUDA"
// (pack_combine_handler.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxPackCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxCombineCuda);

// Registered as "moe_jax_row_matmul" for platform "CUDA" (row_matmul_handler.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxRowMatmulCuda);

// Registered as "moe_jax_grouped_matmul" for platform "CUDA"
// (grouped_gemm_handler.cc; Hopper GPUs).
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxGroupedMatmulCuda);

#endif  // MOE_JAX_CUDA_HANDLERS_CUDA_H_

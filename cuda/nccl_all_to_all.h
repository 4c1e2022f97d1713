// XLA FFI handler stages of moe_jax_nccl_all_to_all (platform "CUDA"): an
// all-to-all of n >= 1 buffers through XLA's own NCCL communicator (see
// nccl_all_to_all.cc and cuda/README.md for the contract).
#ifndef MOE_JAX_CUDA_NCCL_ALL_TO_ALL_H_
#define MOE_JAX_CUDA_NCCL_ALL_TO_ALL_H_

#include "xla/ffi/api/api.h"

// Registered together as {"prepare": ..., "execute": ...}.
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxNcclAllToAllPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxNcclAllToAllExecute);

#endif  // MOE_JAX_CUDA_NCCL_ALL_TO_ALL_H_

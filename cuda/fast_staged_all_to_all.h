// XLA FFI handler stages of moe_jax_fast_staged_all_to_all (platform
// "CUDA"): the FAST-scheduled ragged all-to-all, executed with NCCL
// send/recv on XLA's own communicator (see fast_staged_all_to_all.cc and
// docs/design/fast.md). Not command-buffer compatible.
#ifndef MOE_JAX_CUDA_FAST_STAGED_ALL_TO_ALL_H_
#define MOE_JAX_CUDA_FAST_STAGED_ALL_TO_ALL_H_

#include "xla/ffi/api/api.h"

// Registered together as {"prepare": ..., "execute": ...}.
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxFastStagedAllToAllPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxFastStagedAllToAllExecute);

#endif  // MOE_JAX_CUDA_FAST_STAGED_ALL_TO_ALL_H_

// XLA FFI handlers of the NVLink transport (nvlink_handlers.cc), registered
// for platform "CUDA" with a shared prepare stage and a shared initialize
// stage (MoeJaxNvlinkInitialize: opens the channel of a multi-process mesh
// outside graph capture; without it the first execution does):
//   moe_jax_nvlink_dispatch / _combine (both halves) and the halves alone,
//   moe_jax_nvlink_dispatch_send / _dispatch_recv / _combine_send / _combine_recv,
//   and for fp8 dispatch moe_jax_nvlink_dispatch_fp8 / _dispatch_recv_fp8
#ifndef MOE_JAX_CUDA_NVLINK_HANDLERS_H_
#define MOE_JAX_CUDA_NVLINK_HANDLERS_H_

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxNvlinkPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxNvlinkInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxNvlinkDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxNvlinkCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxNvlinkDispatchSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxNvlinkDispatchRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxNvlinkCombineSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxNvlinkCombineRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxNvlinkDispatchFp8);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxNvlinkDispatchRecvFp8);

#endif  // MOE_JAX_CUDA_NVLINK_HANDLERS_H_

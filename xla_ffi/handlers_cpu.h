// XLA FFI handler symbols of the moe_jax CPU custom calls. Register each for
// platform "cpu" under the target name in the comment.
#ifndef MOE_JAX_XLA_FFI_HANDLERS_CPU_H_
#define MOE_JAX_XLA_FFI_HANDLERS_CPU_H_

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxPackCpu);      // "moe_jax_pack"
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxCombineCpu);   // "moe_jax_combine"
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxAllToAllCpu);  // "moe_jax_all_to_all"

#endif  // MOE_JAX_XLA_FFI_HANDLERS_CPU_H_

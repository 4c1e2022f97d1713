// moe_jax_combine on the CPU: weighted merge of the rows returned to this
// rank back into token order (see docs/design/custom_calls.md). Plain C++,
// no XLA types. Built with -ffp-contract=off: the float32 accumulation is
// multiply-round-add-round in k order, never fused.
#ifndef MOE_JAX_XLA_FFI_COMBINE_CPU_H_
#define MOE_JAX_XLA_FFI_COMBINE_CPU_H_

#include <cstdint>
#include <string>

#include "xla_ffi/float_type.h"

namespace moe_jax::cpu {

struct CombineArgs {
  FloatType in_type = FloatType::kF32;   // dtype of cap_ret and spill_ret
  FloatType out_type = FloatType::kF32;  // dtype of out
  const void* cap_ret = nullptr;         // [P, C, H]
  const void* spill_ret = nullptr;       // [P, S, H]
  int64_t num_ranks = 0;                 // P
  int64_t capacity = 0;                  // C
  int64_t spill_capacity = 0;            // S
  int64_t hidden = 0;                    // H
  const int32_t* dest = nullptr;         // [N]
  const int32_t* pos = nullptr;          // [N]
  const float* weights = nullptr;        // [T, k]
  int64_t num_tokens = 0;                // T
  int64_t top_k = 1;                     // k
  int64_t start = 0;
  void* out = nullptr;                   // [T, H]
};

// Writes every row of out. Returns "" on success, otherwise a description of
// the malformed input (start < 0, top_k < 1, or a slot inside the windows
// whose dest is outside [0, P)); out is then unspecified.
std::string Combine(const CombineArgs& args);

}  // namespace moe_jax::cpu

#endif  // MOE_JAX_XLA_FFI_COMBINE_CPU_H_

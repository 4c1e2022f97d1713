// moe_jax_row_matmul on the CPU: a grouped matmul whose every output row is,
// bit for bit, a function of its input row and its group's weights only
// (see docs/design/custom_calls.md). Register the handler for platform "cpu"
// under the target name "moe_jax_row_matmul".
#ifndef MOE_JAX_XLA_FFI_ROW_MATMUL_CPU_H_
#define MOE_JAX_XLA_FFI_ROW_MATMUL_CPU_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/float_type.h"

namespace moe_jax::cpu {

struct RowMatmulArgs {
  FloatType in_type = FloatType::kF32;  // of x and w: kF32 or kBF16
  const void* x = nullptr;              // [M, K]
  const void* w = nullptr;              // [G, K, N]
  const int32_t* group_sizes = nullptr;  // [G]
  float* out = nullptr;                 // [M, N]
  int64_t rows = 0;                     // M
  int64_t depth = 0;                    // K
  int64_t cols = 0;                     // N
  int64_t groups = 0;                   // G
};

// out[i, n] = sum over k = 0, 1, ..., K-1 of f32(x[i, k]) * f32(w[g(i), k, n]),
// starting from +0.0f, every multiply and add rounded to float32 on its own.
// Group g owns the rows [s_g, s_g + max(group_sizes[g], 0)) cut to [0, M),
// s_g being the sum of the earlier groups' sizes; every other row is +0.0f.
void RowMatmul(const RowMatmulArgs& args);

}  // namespace moe_jax::cpu

// moe_jax_row_matmul(x, w, group_sizes) -> out.
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeJaxRowMatmulCpu);

#endif  // MOE_JAX_XLA_FFI_ROW_MATMUL_CPU_H_

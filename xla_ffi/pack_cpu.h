// moe_jax_pack on the CPU: gathers token rows into per-destination buffers of
// fixed capacity (see docs/design/custom_calls.md). Plain C++, no XLA types.
#ifndef MOE_JAX_XLA_FFI_PACK_CPU_H_
#define MOE_JAX_XLA_FFI_PACK_CPU_H_

#include <cstdint>
#include <string>

namespace moe_jax::cpu {

struct PackArgs {
  const void* x = nullptr;  // [T, H] rows of row_bytes bytes each
  int64_t num_tokens = 0;   // T
  int64_t row_bytes = 0;    // H * element size (the copy is dtype-agnostic)
  const int32_t* sorted_slots = nullptr;  // [N], N = T * top_k
  const int32_t* send_offsets = nullptr;  // [P]
  const int32_t* send_counts = nullptr;   // [P]
  int64_t num_ranks = 0;                  // P
  int64_t top_k = 1;
  int64_t start = 0;
  int64_t capacity = 0;        // C
  int64_t spill_capacity = 0;  // S
  void* cap_buf = nullptr;     // [P, C, H]
  void* spill_buf = nullptr;   // [P, S, H]
};

// Writes every row of cap_buf and spill_buf exactly once (a row of x or
// zeros). Returns "" on success, otherwise a description of the malformed
// input (attributes out of range, a stream [send_offsets[p],
// send_offsets[p] + send_counts[p]) outside [0, N), or a slot id read from
// sorted_slots outside [0, N)); the outputs are then unspecified.
std::string Pack(const PackArgs& args);

}  // namespace moe_jax::cpu

#endif  // MOE_JAX_XLA_FFI_PACK_CPU_H_

// bfloat16 <-> float32 conversions on raw bit patterns (no XLA dependency).
#ifndef MOE_JAX_XLA_FFI_BF16_H_
#define MOE_JAX_XLA_FFI_BF16_H_

#include <cstdint>
#include <cstring>

namespace moe_jax {

// Exact: a bfloat16 is the upper half of a float32.
inline float Bf16ToF32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest, ties to even. Overflow rounds to +-inf, -0.0 stays -0.0.
// A NaN becomes the quiet NaN of its sign (0x7fc0 / 0xffc0), as XLA:CPU's
// and ml_dtypes' float32 -> bfloat16 conversions do.
inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>(((bits >> 16) & 0x8000u) | 0x7fc0u);
  }
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

}  // namespace moe_jax

#endif  // MOE_JAX_XLA_FFI_BF16_H_

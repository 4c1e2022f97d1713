// IEEE binary16 <-> float32 conversions on raw bit patterns (no XLA
// dependency, no reliance on compiler support for _Float16).
#ifndef MOE_JAX_XLA_FFI_F16_H_
#define MOE_JAX_XLA_FFI_F16_H_

#include <cstdint>
#include <cstring>

namespace moe_jax {

// Exact for every input, subnormals included. NaN payloads are kept.
inline float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);  // inf or NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);  // normal
  } else if (man == 0) {
    bits = sign;  // +-0
  } else {
    // Subnormal: man * 2^-24, exactly representable as a normal float.
    float mag = static_cast<float>(man) * 5.9604644775390625e-08f;
    std::memcpy(&bits, &mag, sizeof(bits));
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest, ties to even, including into the subnormal range.
// Overflow rounds to +-inf, -0.0 stays -0.0, a NaN stays a quiet NaN with the
// sign and the top payload bits kept (as XLA:CPU's float32 -> float16).
inline uint16_t F32ToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) {  // NaN
    return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  }
  if (a >= 0x477ff000u) {  // >= 65520 (halfway above the f16 max 65504)
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (a >= 0x38800000u) {  // normal f16 range (>= 2^-14)
    const uint32_t rem = a & 0x1fffu;
    uint32_t h = ((a >> 23) - 112u) << 10 | ((a >> 13) & 0x3ffu);
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry
    return static_cast<uint16_t>(sign | h);
  }
  const uint32_t e = a >> 23;
  if (e < 102u) {  // below 2^-25: rounds to zero
    return sign;
  }
  // Subnormal result q * 2^-24 with q = RNE(mantissa * 2^(e - 126)).
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14 .. 24
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // q == 0x400 is 2^-14
  return static_cast<uint16_t>(sign | q);
}

}  // namespace moe_jax

#endif  // MOE_JAX_XLA_FFI_F16_H_

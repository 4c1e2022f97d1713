// The floating-point element types the pack/combine kernels accept.
#ifndef MOE_JAX_XLA_FFI_FLOAT_TYPE_H_
#define MOE_JAX_XLA_FFI_FLOAT_TYPE_H_

#include <cstdint>

namespace moe_jax {

enum class FloatType : uint8_t { kF32, kBF16, kF16 };

inline int64_t FloatTypeBytes(FloatType t) {
  return t == FloatType::kF32 ? 4 : 2;
}

inline const char* FloatTypeName(FloatType t) {
  switch (t) {
    case FloatType::kF32: return "f32";
    case FloatType::kBF16: return "bf16";
    case FloatType::kF16: return "f16";
  }
  return "?";
}

}  // namespace moe_jax

#endif  // MOE_JAX_XLA_FFI_FLOAT_TYPE_H_

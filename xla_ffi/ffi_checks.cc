#include "xla_ffi/ffi_checks.h"

#include <sstream>

namespace moe_jax::ffi_checks {

std::string DtypeName(ffi::DataType t) {
  using D = ffi::DataType;
  switch (t) {
    case D::PRED: return "pred";
    case D::S1: return "s1";
    case D::S2: return "s2";
    case D::S4: return "s4";
    case D::S8: return "s8";
    case D::S16: return "s16";
    case D::S32: return "s32";
    case D::S64: return "s64";
    case D::U1: return "u1";
    case D::U2: return "u2";
    case D::U4: return "u4";
    case D::U8: return "u8";
    case D::U16: return "u16";
    case D::U32: return "u32";
    case D::U64: return "u64";
    case D::F16: return "f16";
    case D::F32: return "f32";
    case D::F64: return "f64";
    case D::BF16: return "bf16";
    case D::C64: return "c64";
    case D::C128: return "c128";
    case D::TOKEN: return "token";
    case D::F8E5M2: return "f8e5m2";
    case D::F8E4M3: return "f8e4m3";
    case D::F8E4M3FN: return "f8e4m3fn";
    case D::F8E4M3B11FNUZ: return "f8e4m3b11fnuz";
    case D::F8E5M2FNUZ: return "f8e5m2fnuz";
    case D::F8E4M3FNUZ: return "f8e4m3fnuz";
    case D::F8E3M4: return "f8e3m4";
    case D::F4E2M1FN: return "f4e2m1fn";
    case D::F8E8M0FNU: return "f8e8m0fnu";
    default: break;
  }
  return "dtype#" + std::to_string(static_cast<int>(t));
}

std::string Describe(const ffi::AnyBuffer& b) {
  std::ostringstream os;
  os << DtypeName(b.element_type()) << "[";
  const auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? "," : "") << dims[i];
  os << "]";
  return os.str();
}

std::string Dims(std::initializer_list<int64_t> dims) {
  std::ostringstream os;
  os << "[";
  bool first = true;
  for (int64_t d : dims) {
    os << (first ? "" : ", ") << d;
    first = false;
  }
  os << "]";
  return os.str();
}

bool HasDims(const ffi::AnyBuffer& b, std::initializer_list<int64_t> dims) {
  const auto got = b.dimensions();
  if (got.size() != dims.size()) return false;
  size_t i = 0;
  for (int64_t d : dims) {
    if (got[i++] != d) return false;
  }
  return true;
}

bool IsS32(const ffi::AnyBuffer& b, std::initializer_list<int64_t> dims) {
  return b.element_type() == ffi::DataType::S32 && HasDims(b, dims);
}

std::optional<FloatType> ToFloatType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return FloatType::kF32;
    case ffi::DataType::BF16: return FloatType::kBF16;
    case ffi::DataType::F16: return FloatType::kF16;
    default: return std::nullopt;
  }
}

ffi::Error Invalid(const char* call, const char* kind, const char* name,
                   const std::string& expected, const ffi::AnyBuffer& got) {
  return ffi::Error::InvalidArgument(std::string(call) + ": " + kind + " '" +
                                     name + "' must be " + expected +
                                     "; got " + Describe(got));
}

ffi::Error InvalidAttr(const char* call, const char* name,
                       const std::string& expected, int64_t got) {
  return ffi::Error::InvalidArgument(std::string(call) + ": attribute '" +
                                     name + "' must be " + expected + "; got " +
                                     std::to_string(got));
}

}  // namespace moe_jax::ffi_checks

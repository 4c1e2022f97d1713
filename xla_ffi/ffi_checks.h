// Validation helpers of the XLA FFI handlers, CPU (xla_ffi/) and CUDA
// (cuda/): buffer descriptions, shape and dtype predicates, and the errors
// that name the custom call and the offending operand, result or attribute.
// Header-only.
//
//   constexpr CustomCall kPack{"moe_jax_pack", Spelling::kCpu};
//   if (!IsS32(counts, {P})) return Bad(kPack, "send_counts", "...", counts);
//
// The two platforms spell their messages slightly differently, and tests
// match on both (tests/test_custom_calls.py, cuda/tests/handlers_cuda_test.cc):
//   CPU   moe_jax_pack: operand 'x' must be <expected>; got f64[4,8]
//   CUDA  moe_jax_pack: operand `x` must be <expected>, got f64[4, 8]
// so a CustomCall carries its Spelling. A plain name converts to a CustomCall
// with the CUDA spelling.
//
// The CUDA helpers at the end (CudaErrorText, LaunchError) are declared where
// <cuda_runtime_api.h> was included before this header.
#ifndef MOE_JAX_XLA_FFI_FFI_CHECKS_H_
#define MOE_JAX_XLA_FFI_FFI_CHECKS_H_

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/float_type.h"

namespace moe_jax::ffi_checks {

namespace ffi = ::xla::ffi;

// How a platform's handlers write their messages (see the file comment).
enum class Spelling { kCuda, kCpu };

// The custom-call target name that starts every message, and its spelling.
struct CustomCall {
  // NOLINTNEXTLINE(google-explicit-constructor): names convert implicitly.
  constexpr CustomCall(std::string_view name,
                       Spelling spelling = Spelling::kCuda)
      : name(name), spelling(spelling) {}

  std::string_view name;
  Spelling spelling;
};

// "s32", "bf16", ... as XLA spells them; "other" for a type not listed.
inline std::string_view DTypeName(ffi::DataType t) {
  using D = ffi::DataType;
  switch (t) {
    case D::PRED:
      return "pred";
    case D::S1:
      return "s1";
    case D::S2:
      return "s2";
    case D::S4:
      return "s4";
    case D::S8:
      return "s8";
    case D::S16:
      return "s16";
    case D::S32:
      return "s32";
    case D::S64:
      return "s64";
    case D::U1:
      return "u1";
    case D::U2:
      return "u2";
    case D::U4:
      return "u4";
    case D::U8:
      return "u8";
    case D::U16:
      return "u16";
    case D::U32:
      return "u32";
    case D::U64:
      return "u64";
    case D::F16:
      return "f16";
    case D::F32:
      return "f32";
    case D::F64:
      return "f64";
    case D::BF16:
      return "bf16";
    case D::C64:
      return "c64";
    case D::C128:
      return "c128";
    case D::TOKEN:
      return "token";
    case D::F8E5M2:
      return "f8e5m2";
    case D::F8E4M3:
      return "f8e4m3";
    case D::F8E4M3FN:
      return "f8e4m3fn";
    case D::F8E4M3B11FNUZ:
      return "f8e4m3b11fnuz";
    case D::F8E5M2FNUZ:
      return "f8e5m2fnuz";
    case D::F8E4M3FNUZ:
      return "f8e4m3fnuz";
    case D::F8E3M4:
      return "f8e3m4";
    case D::F4E2M1FN:
      return "f4e2m1fn";
    case D::F8E8M0FNU:
      return "f8e8m0fnu";
    default:
      return "other";
  }
}

// Elements the FFI API describes as whole bytes. Sub-byte types are packed on
// GPU (ByteWidth reports 1 for them), so their size in memory is not
// element_count * ByteWidth; callers refuse them rather than miscount.
inline bool ByteSized(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::INVALID:
    case ffi::DataType::TOKEN:
    case ffi::DataType::S1:
    case ffi::DataType::S2:
    case ffi::DataType::S4:
    case ffi::DataType::U1:
    case ffi::DataType::U2:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN:
      return false;
    default:
      return ffi::ByteWidth(t) > 0;
  }
}

// f32 / bf16 / f16, the element types of the pack, combine and row-matmul
// kernels; nullopt for any other.
inline std::optional<FloatType> ToFloatType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return FloatType::kF32;
    case ffi::DataType::BF16:
      return FloatType::kBF16;
    case ffi::DataType::F16:
      return FloatType::kF16;
    default:
      return std::nullopt;
  }
}

// "[4, 8]".
inline std::string Dims(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  bool first = true;
  for (int64_t d : dims) {
    if (!first) s += ", ";
    first = false;
    s += std::to_string(d);
  }
  return s + ']';
}

// "s32[4, 8]".
inline std::string Shape(std::string_view dtype,
                         std::initializer_list<int64_t> dims) {
  return std::string(dtype) + Dims(dims);
}

// A buffer's dtype and shape: "s32[4, 8]" (CUDA) or "s32[4,8]" (CPU).
inline std::string Describe(const ffi::AnyBuffer& b,
                            Spelling spelling = Spelling::kCuda) {
  const char* sep = spelling == Spelling::kCpu ? "," : ", ";
  std::string s(DTypeName(b.element_type()));
  s += '[';
  const auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += sep;
    s += std::to_string(dims[i]);
  }
  return s + ']';
}

inline bool HasDims(const ffi::AnyBuffer& b,
                    std::initializer_list<int64_t> want) {
  const auto dims = b.dimensions();
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (dims[i++] != w) return false;
  }
  return true;
}

// s32 of exactly the shape `dims`.
inline bool IsS32(const ffi::AnyBuffer& b,
                  std::initializer_list<int64_t> dims) {
  return b.element_type() == ffi::DataType::S32 && HasDims(b, dims);
}

// s32 of rank 1, any length.
inline bool IsS32Vector(const ffi::AnyBuffer& b) {
  return b.element_type() == ffi::DataType::S32 && b.dimensions().size() == 1;
}

// "<call>: <what>".
inline std::string Prefixed(const CustomCall& call, std::string_view what) {
  std::string s(call.name);
  s += ": ";
  s += what;
  return s;
}

// INVALID_ARGUMENT "<call>: <what>".
inline ffi::Error Invalid(const CustomCall& call, std::string_view what) {
  return ffi::Error::InvalidArgument(Prefixed(call, what));
}

// INTERNAL "<call>: <what>".
inline ffi::Error Internal(const CustomCall& call, std::string_view what) {
  return ffi::Error::Internal(Prefixed(call, what));
}

// INVALID_ARGUMENT "<call>: <kind> `<name>` must be <expected>, got <got>"
// (CPU: 'name' and "; got"), `kind` being "operand" or "result".
inline ffi::Error Mismatch(const CustomCall& call, std::string_view kind,
                           std::string_view name, const std::string& expected,
                           const ffi::AnyBuffer& got) {
  const bool cpu = call.spelling == Spelling::kCpu;
  const char quote = cpu ? '\'' : '`';
  return Invalid(call, std::string(kind) + " " + quote + std::string(name) +
                           quote + " must be " + expected +
                           (cpu ? "; got " : ", got ") +
                           Describe(got, call.spelling));
}

inline ffi::Error Bad(const CustomCall& call, std::string_view operand,
                      const std::string& expected, const ffi::AnyBuffer& got) {
  return Mismatch(call, "operand", operand, expected, got);
}

inline ffi::Error BadResult(const CustomCall& call, std::string_view result,
                            const std::string& expected,
                            const ffi::AnyBuffer& got) {
  return Mismatch(call, "result", result, expected, got);
}

// INVALID_ARGUMENT "<call>: attribute `<attr>` must be <requirement>, got
// <value>" (CPU: 'attr' and "; got").
inline ffi::Error BadAttr(const CustomCall& call, std::string_view attr,
                          int64_t value, std::string_view requirement) {
  const bool cpu = call.spelling == Spelling::kCpu;
  const char quote = cpu ? '\'' : '`';
  return Invalid(call, "attribute " + (quote + std::string(attr) + quote) +
                           " must be " + std::string(requirement) +
                           (cpu ? "; got " : ", got ") + std::to_string(value));
}

#ifdef CUDART_VERSION  // <cuda_runtime_api.h> is in: the CUDA handlers.

// "<cudaGetErrorName>: <cudaGetErrorString>".
inline std::string CudaErrorText(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

// INTERNAL "<call>: CUDA kernel launch failed: <CudaErrorText>".
inline ffi::Error LaunchError(const CustomCall& call, cudaError_t err) {
  return Internal(call, "CUDA kernel launch failed: " + CudaErrorText(err));
}

#endif  // CUDART_VERSION

}  // namespace moe_jax::ffi_checks

// The CUDA handlers (namespace moe_jax::cuda) call these unqualified.
namespace moe_jax::cuda {
using namespace ::moe_jax::ffi_checks;  // NOLINT(google-build-using-namespace)
}  // namespace moe_jax::cuda

#endif  // MOE_JAX_XLA_FFI_FFI_CHECKS_H_

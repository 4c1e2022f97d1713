// Operand/attribute validation messages shared by the CUDA FFI handlers:
// every error names the custom call, the operand and what it must be.
#ifndef MOE_JAX_CUDA_FFI_MESSAGES_H_
#define MOE_JAX_CUDA_FFI_MESSAGES_H_

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include <cuda_runtime_api.h>

#include "pack_combine.h"
#include "xla/ffi/api/ffi.h"

namespace moe_jax::cuda {

namespace ffi = xla::ffi;

inline std::string_view DTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "f32";
    case ffi::DataType::BF16: return "bf16";
    case ffi::DataType::F16: return "f16";
    case ffi::DataType::F8E4M3FN: return "f8e4m3fn";
    case ffi::DataType::F64: return "f64";
    case ffi::DataType::S32: return "s32";
    case ffi::DataType::S64: return "s64";
    case ffi::DataType::U32: return "u32";
    case ffi::DataType::PRED: return "pred";
    default: return "other";
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

inline std::string Describe(const ffi::AnyBuffer& b) {
  std::string s(DTypeName(b.element_type()));
  s += '[';
  const auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + ']';
}

inline std::optional<ElemType> FloatType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return ElemType::kF32;
    case ffi::DataType::BF16: return ElemType::kBF16;
    case ffi::DataType::F16: return ElemType::kF16;
    default: return std::nullopt;
  }
}

inline ffi::Error Mismatch(std::string_view call, std::string_view kind,
                    std::string_view name, const std::string& expected,
                    const ffi::AnyBuffer& got) {
  return ffi::Error::InvalidArgument(
      std::string(call) + ": " + std::string(kind) + " `" + std::string(name) +
      "` must be " + expected + ", got " + Describe(got));
}

inline ffi::Error Bad(std::string_view call, std::string_view operand,
               const std::string& expected, const ffi::AnyBuffer& got) {
  return Mismatch(call, "operand", operand, expected, got);
}

inline ffi::Error BadResult(std::string_view call, std::string_view result,
                     const std::string& expected, const ffi::AnyBuffer& got) {
  return Mismatch(call, "result", result, expected, got);
}

inline ffi::Error BadAttr(std::string_view call, std::string_view attr, int64_t value,
                   std::string_view requirement) {
  return ffi::Error::InvalidArgument(std::string(call) + ": attribute `" +
                                     std::string(attr) + "` must be " +
                                     std::string(requirement) + ", got " +
                                     std::to_string(value));
}

inline bool HasDims(const ffi::AnyBuffer& b, std::initializer_list<int64_t> want) {
  const auto dims = b.dimensions();
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (dims[i++] != w) return false;
  }
  return true;
}

inline std::string Shape(std::string_view dtype, std::initializer_list<int64_t> dims) {
  std::string s(dtype);
  s += '[';
  bool first = true;
  for (int64_t d : dims) {
    if (!first) s += ", ";
    first = false;
    s += std::to_string(d);
  }
  return s + ']';
}

inline bool IsS32Vector(const ffi::AnyBuffer& b) {
  return b.element_type() == ffi::DataType::S32 && b.dimensions().size() == 1;
}

inline ffi::Error LaunchError(std::string_view call, cudaError_t err) {
  return ffi::Error::Internal(std::string(call) + ": CUDA kernel launch failed: " +
                              cudaGetErrorName(err) + ": " +
                              cudaGetErrorString(err));
}

}  // namespace moe_jax::cuda

#endif  // MOE_JAX_CUDA_FFI_MESSAGES_H_

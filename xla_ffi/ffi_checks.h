// Helpers for the CPU FFI bindings: describe buffers and build the error that
// names an offending operand, result or attribute.
#ifndef MOE_JAX_XLA_FFI_FFI_CHECKS_H_
#define MOE_JAX_XLA_FFI_FFI_CHECKS_H_

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/float_type.h"

namespace moe_jax::ffi_checks {

namespace ffi = ::xla::ffi;

// "s32", "bf16", ... as XLA spells them.
std::string DtypeName(ffi::DataType t);

// "s32[4,8]".
std::string Describe(const ffi::AnyBuffer& b);

// "[4, 8]".
std::string Dims(std::initializer_list<int64_t> dims);

bool HasDims(const ffi::AnyBuffer& b, std::initializer_list<int64_t> dims);

bool IsS32(const ffi::AnyBuffer& b, std::initializer_list<int64_t> dims);

std::optional<FloatType> ToFloatType(ffi::DataType t);

// InvalidArgument("<call>: <kind> '<name>' must be <expected>; got <b>").
ffi::Error Invalid(const char* call, const char* kind, const char* name,
                   const std::string& expected, const ffi::AnyBuffer& got);

// InvalidArgument("<call>: attribute '<name>' must be <expected>; got <v>").
ffi::Error InvalidAttr(const char* call, const char* name,
                       const std::string& expected, int64_t got);

}  // namespace moe_jax::ffi_checks

#endif  // MOE_JAX_XLA_FFI_FFI_CHECKS_H_

// Compiled with -ffp-contract=off -fno-fast-math (see CMakeLists.txt): every
// multiply and add below is rounded on its own, in the order written. Loops
// may be vectorized across output columns only, which leaves each column's
// sum over k in increasing order.
#include "xla_ffi/row_matmul_cpu.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/bf16.h"
#include "xla_ffi/ffi_checks.h"

namespace moe_jax::cpu {
namespace {

// Rows and columns of the accumulator block kept in registers / L1.
constexpr int64_t kRowBlock = 8;
constexpr int64_t kColBlock = 256;

inline float ToF32(float v) { return v; }
inline float ToF32(uint16_t bf16) { return Bf16ToF32(bf16); }

// out rows [row_begin, row_end) = x rows times w_g ([K, N]).
template <typename In>
void MultiplyRows(const RowMatmulArgs& a, const In* x, const In* w_g,
                  int64_t row_begin, int64_t row_end) {
  const int64_t K = a.depth, N = a.cols;
  float acc[kRowBlock][kColBlock];
  float w_k[kColBlock];
  for (int64_t r0 = row_begin; r0 < row_end; r0 += kRowBlock) {
    const int64_t nr = std::min(kRowBlock, row_end - r0);
    for (int64_t c0 = 0; c0 < N; c0 += kColBlock) {
      const int64_t nc = std::min(kColBlock, N - c0);
      for (int64_t r = 0; r < nr; ++r) std::fill_n(acc[r], nc, 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const In* w_row = w_g + k * N + c0;
        for (int64_t c = 0; c < nc; ++c) w_k[c] = ToF32(w_row[c]);
        for (int64_t r = 0; r < nr; ++r) {
          const float x_rk = ToF32(x[(r0 + r) * K + k]);
          float* acc_r = acc[r];
          for (int64_t c = 0; c < nc; ++c) acc_r[c] = acc_r[c] + x_rk * w_k[c];
        }
      }
      for (int64_t r = 0; r < nr; ++r) {
        std::copy_n(acc[r], nc, a.out + (r0 + r) * N + c0);
      }
    }
  }
}

template <typename In>
void RowMatmulOf(const RowMatmulArgs& a) {
  const In* x = static_cast<const In*>(a.x);
  const In* w = static_cast<const In*>(a.w);
  int64_t begin = 0;  // first row of group g, at most M
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t size = std::max<int64_t>(a.group_sizes[g], 0);
    const int64_t end = std::min(begin + size, a.rows);
    MultiplyRows(a, x, w + g * a.depth * a.cols, begin, end);
    begin = end;
  }
  std::fill(a.out + begin * a.cols, a.out + a.rows * a.cols, 0.0f);
}

}  // namespace

void RowMatmul(const RowMatmulArgs& a) {
  if (a.in_type == FloatType::kBF16) {
    RowMatmulOf<uint16_t>(a);
  } else {
    RowMatmulOf<float>(a);
  }
}

}  // namespace moe_jax::cpu

namespace moe_jax {
namespace {

namespace ffi = ::xla::ffi;
using ffi_checks::Bad;
using ffi_checks::BadResult;
using ffi_checks::CustomCall;
using ffi_checks::Dims;
using ffi_checks::Spelling;

constexpr CustomCall kRowMatmul{"moe_jax_row_matmul", Spelling::kCpu};

// moe_jax_row_matmul(x, w, group_sizes) -> out
ffi::Error RowMatmulImpl(ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::AnyBuffer group_sizes,
                         ffi::Result<ffi::AnyBuffer> out) {
  const auto xt = ffi_checks::ToFloatType(x.element_type());
  if (!xt || *xt == FloatType::kF16 || x.dimensions().size() != 2) {
    return Bad(kRowMatmul, "x", "f32 or bf16 of shape [M, K]", x);
  }
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  const auto wd = w.dimensions();
  if (w.element_type() != x.element_type() || wd.size() != 3 || wd[1] != K) {
    return Bad(kRowMatmul, "w",
               "of x's dtype and shape [G, K, N] with K = " + std::to_string(K),
               w);
  }
  const int64_t G = wd[0], N = wd[2];
  if (!ffi_checks::IsS32(group_sizes, {G})) {
    return Bad(kRowMatmul, "group_sizes", "int32 of shape [G] = " + Dims({G}),
               group_sizes);
  }
  if (out->element_type() != ffi::DataType::F32 ||
      !ffi_checks::HasDims(*out, {M, N})) {
    return BadResult(kRowMatmul, "out", "f32 of shape [M, N] = " + Dims({M, N}),
                     *out);
  }
  cpu::RowMatmulArgs a;
  a.in_type = *xt;
  a.x = x.untyped_data();
  a.w = w.untyped_data();
  a.group_sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  a.out = static_cast<float*>(out->untyped_data());
  a.rows = M;
  a.depth = K;
  a.cols = N;
  a.groups = G;
  cpu::RowMatmul(a);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeJaxRowMatmulCpu, moe_jax::RowMatmulImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // w
                                  .Arg<xla::ffi::AnyBuffer>()  // group_sizes
                                  .Ret<xla::ffi::AnyBuffer>());  // out

#include "xla_ffi/combine_cpu.h"

#include <cstring>
#include <string>
#include <vector>

#include "xla_ffi/bf16.h"
#include "xla_ffi/f16.h"

namespace moe_jax::cpu {
namespace {

struct F32Io {
  using Storage = float;
  static float Load(float v) { return v; }
  static float Store(float v) { return v; }
};
struct Bf16Io {
  using Storage = uint16_t;
  static float Load(uint16_t v) { return Bf16ToF32(v); }
  static uint16_t Store(float v) { return F32ToBf16(v); }
};
struct F16Io {
  using Storage = uint16_t;
  static float Load(uint16_t v) { return F16ToF32(v); }
  static uint16_t Store(float v) { return F32ToF16(v); }
};

// acc[h] = acc[h] + w * f32(y[h]): the product is rounded to float before
// the add (the file is compiled with -ffp-contract=off, so no FMA).
template <typename In>
void Accumulate(float* acc, const typename In::Storage* y, float w,
                int64_t hidden) {
  for (int64_t h = 0; h < hidden; ++h) {
    const float prod = w * In::Load(y[h]);
    acc[h] = acc[h] + prod;
  }
}

template <typename In, typename Out>
std::string CombineTyped(const CombineArgs& a) {
  using InT = typename In::Storage;
  using OutT = typename Out::Storage;
  const InT* cap = static_cast<const InT*>(a.cap_ret);
  const InT* spill = static_cast<const InT*>(a.spill_ret);
  OutT* out = static_cast<OutT*>(a.out);
  const int64_t H = a.hidden, C = a.capacity, S = a.spill_capacity;
  std::vector<float> acc(static_cast<size_t>(H));
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    // Starts at +0.0f. An absent slot adds +0.0f, which leaves any float
    // other than -0.0f unchanged (NaN included), and acc can never be -0.0f
    // since it starts at +0.0f and x + (-x) rounds to +0.0f; so absent
    // slots are skipped without changing a bit of the result.
    for (int64_t h = 0; h < H; ++h) acc[h] = 0.0f;
    for (int64_t j = 0; j < a.top_k; ++j) {
      const int64_t n = t * a.top_k + j;
      const int64_t p = a.pos[n];
      if (p < a.start) continue;  // before the windows: contributes +0.0f
      const int64_t q = p - a.start;
      const bool in_cap = q < C;
      if (!in_cap && q - C >= S) continue;  // after both windows: +0.0f
      const int32_t d = a.dest[n];
      if (d < 0 || d >= a.num_ranks) {
        return "dest[" + std::to_string(n) + "] = " + std::to_string(d) +
               " is outside [0, P=" + std::to_string(a.num_ranks) +
               ") for a slot inside the windows (pos[" + std::to_string(n) +
               "] = " + std::to_string(a.pos[n]) + ")";
      }
      const InT* row = in_cap ? cap + (d * C + q) * H
                              : spill + (d * S + (q - C)) * H;
      Accumulate<In>(acc.data(), row, a.weights[n], H);
    }
    for (int64_t h = 0; h < H; ++h) out[t * H + h] = Out::Store(acc[h]);
  }
  return {};
}

template <typename In>
std::string CombineIn(const CombineArgs& a) {
  switch (a.out_type) {
    case FloatType::kF32: return CombineTyped<In, F32Io>(a);
    case FloatType::kBF16: return CombineTyped<In, Bf16Io>(a);
    case FloatType::kF16: return CombineTyped<In, F16Io>(a);
  }
  return "unsupported output type";
}

}  // namespace

std::string Combine(const CombineArgs& a) {
  if (a.top_k < 1) return "top_k must be >= 1, got " + std::to_string(a.top_k);
  if (a.start < 0) return "start must be >= 0, got " + std::to_string(a.start);
  switch (a.in_type) {
    case FloatType::kF32: return CombineIn<F32Io>(a);
    case FloatType::kBF16: return CombineIn<Bf16Io>(a);
    case FloatType::kF16: return CombineIn<F16Io>(a);
  }
  return "unsupported input type";
}

}  // namespace moe_jax::cpu

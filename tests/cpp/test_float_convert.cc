// bf16 / f16 <-> f32 conversions: exactness, round-to-nearest-even (ties to
// even, into subnormals, overflow to inf), -0.0, NaN stays NaN. Checked
// against an independent reference that picks the nearest representable
// value with double arithmetic.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "tests/cpp/check.h"
#include "xla_ffi/bf16.h"
#include "xla_ffi/f16.h"

namespace {

using moe_jax::Bf16ToF32;
using moe_jax::F16ToF32;
using moe_jax::F32ToBf16;
using moe_jax::F32ToF16;

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Value of a binary16 pattern, computed independently of F16ToF32.
double F16Value(uint16_t h) {
  const int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (exp == 0x1f) return man ? NAN : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(man, -24);
  return sign * std::ldexp(1024 + man, exp - 25);
}

// Nearest-even rounding of a finite float to a format whose non-negative
// finite patterns 0..max_pattern are increasing in value, with `value`
// giving each pattern's value and `inf_pattern` the overflow result. The
// rounding boundary above max_pattern is max + half an ulp (IEEE overflow).
template <typename ValueFn>
uint16_t RefRound(float f, uint16_t max_pattern, uint16_t inf_pattern,
                  uint16_t sign_bit, ValueFn value) {
  const double x = std::fabs(static_cast<double>(f));
  const uint16_t sign = std::signbit(f) ? sign_bit : 0;
  const double max = value(max_pattern);
  const double ulp = max - value(max_pattern - 1);
  if (x >= max + ulp / 2) return sign | inf_pattern;
  // Binary search for the largest pattern with value <= x.
  uint32_t lo = 0, hi = max_pattern;
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (value(mid) <= x) lo = mid; else hi = mid - 1;
  }
  if (lo == max_pattern) return sign | lo;
  const double below = value(lo), above = value(lo + 1);
  uint32_t r;
  if (x - below < above - x) r = lo;
  else if (x - below > above - x) r = lo + 1;
  else r = (lo & 1) ? lo + 1 : lo;  // tie: even
  return static_cast<uint16_t>(sign | r);
}

uint16_t RefF16(float f) {
  return RefRound(f, 0x7bff, 0x7c00, 0x8000,
                  [](uint32_t p) { return F16Value(static_cast<uint16_t>(p)); });
}
uint16_t RefBf16(float f) {
  return RefRound(f, 0x7f7f, 0x7f80, 0x8000, [](uint32_t p) {
    return static_cast<double>(FromBits(p << 16));
  });
}

bool IsNanBf16(uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x7f); }
bool IsNanF16(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff); }

// Floats to test: every exponent with mantissas near rounding boundaries,
// a stride through all bit patterns, and random ones.
std::vector<uint32_t> SampleBits() {
  std::vector<uint32_t> v;
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t e = 0; e < 255; ++e) {
      for (uint32_t low : {0u, 1u, 0xfffu, 0x1000u, 0x1001u, 0x1fffu, 0x2000u,
                           0x3000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu,
                           0x18000u, 0x7fffffu, 0x7fe000u, 0x7ff000u}) {
        for (uint32_t high : {0u, 0x10000u, 0x2000u, 0x7f0000u, 0x400000u}) {
          v.push_back(sign << 31 | e << 23 | ((high | low) & 0x7fffff));
        }
      }
    }
  }
  for (uint64_t b = 0; b < (1ull << 32); b += 40961) v.push_back(uint32_t(b));
  std::mt19937 rng(7);
  for (int i = 0; i < 300000; ++i) v.push_back(rng());
  return v;
}

void TestBf16Exact() {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Bf16ToF32(static_cast<uint16_t>(h));
    CHECK_EQ(Bits(f), h << 16);
    if (!IsNanBf16(static_cast<uint16_t>(h))) {
      CHECK_EQ(F32ToBf16(f), static_cast<uint16_t>(h));
    } else {
      CHECK(IsNanBf16(F32ToBf16(f)));
    }
  }
}

void TestBf16Cases() {
  CHECK_EQ(F32ToBf16(1.0f), 0x3f80);
  CHECK_EQ(F32ToBf16(FromBits(0x3f808000u)), 0x3f80);  // tie, even below
  CHECK_EQ(F32ToBf16(FromBits(0x3f818000u)), 0x3f82);  // tie, even above
  CHECK_EQ(F32ToBf16(FromBits(0x3f808001u)), 0x3f81);  // above the tie
  CHECK_EQ(F32ToBf16(FromBits(0x3f807fffu)), 0x3f80);  // below the tie
  CHECK_EQ(F32ToBf16(FromBits(0xbf818000u)), 0xbf82);  // negative tie
  CHECK_EQ(F32ToBf16(-0.0f), 0x8000);
  CHECK_EQ(F32ToBf16(0.0f), 0x0000);
  CHECK_EQ(F32ToBf16(INFINITY), 0x7f80);
  CHECK_EQ(F32ToBf16(-INFINITY), 0xff80);
  CHECK_EQ(F32ToBf16(FromBits(0x7f7fffffu)), 0x7f80);  // max float -> inf
  CHECK_EQ(F32ToBf16(FromBits(0xff7fffffu)), 0xff80);
  CHECK_EQ(F32ToBf16(FromBits(0x7f7f7fffu)), 0x7f7f);  // stays finite
  CHECK_EQ(F32ToBf16(FromBits(0x00008000u)), 0x0000);  // subnormal tie
  CHECK_EQ(F32ToBf16(FromBits(0x00018000u)), 0x0002);
  CHECK_EQ(F32ToBf16(FromBits(0x80008000u)), 0x8000);  // -> -0.0
  // NaN stays NaN (also when its payload is only in the dropped bits): the
  // quiet NaN of its sign, as XLA:CPU converts.
  CHECK(IsNanBf16(F32ToBf16(NAN)));
  CHECK_EQ(F32ToBf16(FromBits(0x7f800001u)), 0x7fc0);
  CHECK_EQ(F32ToBf16(FromBits(0x7fa12345u)), 0x7fc0);
  CHECK_EQ(F32ToBf16(FromBits(0x7fffffffu)), 0x7fc0);
  CHECK_EQ(F32ToBf16(FromBits(0xffc00000u)), 0xffc0);
  CHECK_EQ(F32ToBf16(FromBits(0xffbfffffu)), 0xffc0);
}

void TestF16Exact() {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t p = static_cast<uint16_t>(h);
    const float f = F16ToF32(p);
    if (IsNanF16(p)) {
      CHECK(std::isnan(f));
      CHECK_EQ(std::signbit(f), (h & 0x8000) != 0);
      CHECK(IsNanF16(F32ToF16(f)));
      continue;
    }
    CHECK_EQ(static_cast<double>(f), F16Value(p));
    CHECK_EQ(std::signbit(f), (h & 0x8000) != 0);
    CHECK_EQ(F32ToF16(f), p);
  }
}

void TestF16Cases() {
  CHECK_EQ(F32ToF16(1.0f), 0x3c00);
  CHECK_EQ(F32ToF16(65504.0f), 0x7bff);
  CHECK_EQ(F32ToF16(65519.996f), 0x7bff);
  CHECK_EQ(F32ToF16(65520.0f), 0x7c00);  // tie above max rounds to inf
  CHECK_EQ(F32ToF16(-65520.0f), 0xfc00);
  CHECK_EQ(F32ToF16(1e10f), 0x7c00);
  CHECK_EQ(F32ToF16(-0.0f), 0x8000);
  CHECK_EQ(F32ToF16(FromBits(0x3f801000u)), 0x3c00);  // tie, even below
  CHECK_EQ(F32ToF16(FromBits(0x3f803000u)), 0x3c02);  // tie, even above
  CHECK_EQ(F32ToF16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  CHECK_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie to zero (even)
  CHECK_EQ(F32ToF16(std::ldexp(1.5f, -25)), 0x0001);
  CHECK_EQ(F32ToF16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 ulp: tie to even
  CHECK_EQ(F32ToF16(-std::ldexp(1.0f, -26)), 0x8000);
  CHECK_EQ(F32ToF16(std::ldexp(1023.5f, -24)), 0x0400);  // to min normal
  CHECK_EQ(F32ToF16(std::ldexp(1.0f, -14)), 0x0400);
  CHECK(IsNanF16(F32ToF16(NAN)));
  CHECK(IsNanF16(F32ToF16(FromBits(0x7f800001u))));
  CHECK_EQ(F32ToF16(FromBits(0xffc00000u)), 0xfe00);
  CHECK_EQ(F32ToF16(FromBits(0x7fa12345u)), 0x7f09);  // top payload bits kept
  CHECK_EQ(F32ToF16(FromBits(0x7f800001u)), 0x7e00);
  CHECK_EQ(F32ToF16(INFINITY), 0x7c00);
}

void TestAgainstReference() {
  int bad_bf16 = 0, bad_f16 = 0;
  for (uint32_t b : SampleBits()) {
    const float f = FromBits(b);
    if (std::isnan(f) || std::isinf(f)) continue;
    if (F32ToBf16(f) != RefBf16(f) && bad_bf16++ < 5) {
      CHECK_EQ(F32ToBf16(f), RefBf16(f));
    }
    if (F32ToF16(f) != RefF16(f) && bad_f16++ < 5) {
      CHECK_EQ(F32ToF16(f), RefF16(f));
    }
  }
  CHECK_EQ(bad_bf16, 0);
  CHECK_EQ(bad_f16, 0);
}

#if defined(__FLT16_MAX__) && (defined(__x86_64__) || defined(__aarch64__))
// Where the compiler has a native _Float16, compare with it too.
void TestAgainstCompiler() {
  int bad = 0;
  for (uint32_t b : SampleBits()) {
    const float f = FromBits(b);
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t hb;
    std::memcpy(&hb, &h, 2);
    if (F32ToF16(f) != hb && bad++ < 5) CHECK_EQ(F32ToF16(f), hb);
  }
  CHECK_EQ(bad, 0);
}
#else
void TestAgainstCompiler() {}
#endif

}  // namespace

int main() {
  TestBf16Exact();
  TestBf16Cases();
  TestF16Exact();
  TestF16Cases();
  TestAgainstReference();
  TestAgainstCompiler();
  return moe_jax_test::Report("test_float_convert");
}

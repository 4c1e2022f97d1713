// moe_jax_combine core: float32 accumulation in k order, product rounded
// before the add (no FMA), absent slots add +0.0f, round-to-nearest-even
// output casts, all 3 x 3 dtype pairs.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tests/cpp/check.h"
#include "tests/cpp/plan.h"
#include "xla_ffi/bf16.h"
#include "xla_ffi/combine_cpu.h"
#include "xla_ffi/f16.h"

namespace {

using moe_jax::FloatType;
using moe_jax::FloatTypeBytes;
using moe_jax::cpu::Combine;
using moe_jax::cpu::CombineArgs;
using moe_jax_test::MakePlan;
using moe_jax_test::Plan;

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Typed storage as raw bytes.
struct Array {
  FloatType type;
  std::vector<unsigned char> bytes;
  Array(FloatType t, size_t n) : type(t), bytes(n * FloatTypeBytes(t), 0xCD) {}
  size_t size() const { return bytes.size() / FloatTypeBytes(type); }
  float Get(size_t i) const {
    if (type == FloatType::kF32) {
      float f;
      std::memcpy(&f, &bytes[4 * i], 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, &bytes[2 * i], 2);
    return type == FloatType::kBF16 ? moe_jax::Bf16ToF32(h) : moe_jax::F16ToF32(h);
  }
  // Stores f rounded to the array's type.
  void Set(size_t i, float f) {
    if (type == FloatType::kF32) {
      std::memcpy(&bytes[4 * i], &f, 4);
      return;
    }
    const uint16_t h = type == FloatType::kBF16 ? moe_jax::F32ToBf16(f)
                                                : moe_jax::F32ToF16(f);
    std::memcpy(&bytes[2 * i], &h, 2);
  }
  uint32_t RawBits(size_t i) const {
    if (type == FloatType::kF32) return Bits(Get(i));
    uint16_t h;
    std::memcpy(&h, &bytes[2 * i], 2);
    return h;
  }
};

struct Inputs {
  int64_t P = 1, C = 0, S = 0, H = 1, T = 0, k = 1, start = 0;
  Array cap{FloatType::kF32, 0}, spill{FloatType::kF32, 0};
  std::vector<int32_t> dest, pos;
  std::vector<float> weights;
};

std::string Run(const Inputs& in, Array& out) {
  CombineArgs a;
  a.in_type = in.cap.type;
  a.out_type = out.type;
  a.cap_ret = in.cap.bytes.data();
  a.spill_ret = in.spill.bytes.data();
  a.num_ranks = in.P;
  a.capacity = in.C;
  a.spill_capacity = in.S;
  a.hidden = in.H;
  a.dest = in.dest.data();
  a.pos = in.pos.data();
  a.weights = in.weights.data();
  a.num_tokens = in.T;
  a.top_k = in.k;
  a.start = in.start;
  a.out = out.bytes.data();
  return Combine(a);
}

// The spec's pseudo-code. volatile keeps every product and sum rounded to
// float even if this file were compiled with contraction on.
float Reference(const Inputs& in, int64_t t, int64_t h) {
  volatile float acc = 0.0f;
  for (int64_t j = 0; j < in.k; ++j) {
    const int64_t n = t * in.k + j;
    const int64_t q = int64_t(in.pos[n]) - in.start;
    volatile float term = 0.0f;
    if (q >= 0 && q < in.C) {
      volatile float prod = in.weights[n] * in.cap.Get((in.dest[n] * in.C + q) * in.H + h);
      term = prod;
    } else if (q >= in.C && q < in.C + in.S) {
      volatile float prod =
          in.weights[n] * in.spill.Get((in.dest[n] * in.S + q - in.C) * in.H + h);
      term = prod;
    }
    acc = acc + term;
  }
  return acc;
}

void CheckAgainstReference(const Inputs& in, FloatType out_type) {
  Array out(out_type, in.T * in.H);
  CHECK_EQ(Run(in, out), std::string());
  Array expected(out_type, in.T * in.H);
  for (int64_t t = 0; t < in.T; ++t) {
    for (int64_t h = 0; h < in.H; ++h) expected.Set(t * in.H + h, Reference(in, t, h));
  }
  int bad = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out.RawBits(i) != expected.RawBits(i) && bad++ < 3) {
      CHECK_EQ(out.RawBits(i), expected.RawBits(i));
    }
  }
  CHECK_EQ(bad, 0);
}

Inputs RandomInputs(const Plan& p, int64_t C, int64_t S, int64_t H,
                    int64_t start, FloatType in_type, std::mt19937& rng) {
  Inputs in;
  in.P = p.P;
  in.C = C;
  in.S = S;
  in.H = H;
  in.T = p.T;
  in.k = p.k;
  in.start = start;
  in.cap = Array(in_type, p.P * C * H);
  in.spill = Array(in_type, p.P * S * H);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (size_t i = 0; i < in.cap.size(); ++i) in.cap.Set(i, normal(rng));
  for (size_t i = 0; i < in.spill.size(); ++i) in.spill.Set(i, normal(rng));
  in.dest = p.dest;
  in.pos = p.pos;
  in.weights.resize(p.T * p.k);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  for (auto& w : in.weights) w = uni(rng);
  return in;
}

constexpr FloatType kTypes[] = {FloatType::kF32, FloatType::kBF16, FloatType::kF16};

void TestRandom() {
  std::mt19937 rng(11);
  for (int i = 0; i < 200; ++i) {
    const Plan p = MakePlan(rng() % 12, 1 + rng() % 4, 1 + rng() % 5, 1 + rng() % 3, rng);
    const FloatType in_t = kTypes[rng() % 3], out_t = kTypes[rng() % 3];
    const Inputs in = RandomInputs(p, rng() % 5, rng() % 5, rng() % 6, rng() % 4, in_t, rng);
    CheckAgainstReference(in, out_t);
  }
  // Every dtype pair, with edge windows: C = 0, S = 0, C = 1, start > 0,
  // everything absent, one destination only, k = 1.
  const Plan p = MakePlan(9, 3, 4, 2, rng);
  const Plan one = MakePlan(7, 2, 3, 2, rng, {0, 1, 0});
  const Plan k1 = MakePlan(8, 1, 2, 2, rng);
  for (FloatType in_t : kTypes) {
    for (FloatType out_t : kTypes) {
      for (const Plan* pl : {&p, &one, &k1}) {
        CheckAgainstReference(RandomInputs(*pl, 0, 0, 4, 0, in_t, rng), out_t);
        CheckAgainstReference(RandomInputs(*pl, 0, 3, 4, 0, in_t, rng), out_t);
        CheckAgainstReference(RandomInputs(*pl, 3, 0, 4, 0, in_t, rng), out_t);
        CheckAgainstReference(RandomInputs(*pl, 1, 1, 4, 1, in_t, rng), out_t);
        CheckAgainstReference(RandomInputs(*pl, 2, 2, 5, 3, in_t, rng), out_t);
        CheckAgainstReference(RandomInputs(*pl, 20, 20, 2, 0, in_t, rng), out_t);
        CheckAgainstReference(RandomInputs(*pl, 2, 2, 3, 50, in_t, rng), out_t);
      }
    }
  }
}

// One token, slots j = 0..k-1 all in the cap window of rank 0, H = 1.
Inputs Manual(const std::vector<float>& w, const std::vector<float>& y,
              FloatType in_t = FloatType::kF32) {
  Inputs in;
  in.P = 1;
  in.C = int64_t(y.size());
  in.S = 0;
  in.H = 1;
  in.T = 1;
  in.k = int64_t(w.size());
  in.cap = Array(in_t, y.size());
  for (size_t i = 0; i < y.size(); ++i) in.cap.Set(i, y[i]);
  in.dest.assign(w.size(), 0);
  for (size_t j = 0; j < w.size(); ++j) in.pos.push_back(int32_t(j));
  in.weights = w;
  return in;
}

float RunOne(const Inputs& in, FloatType out_t = FloatType::kF32) {
  Array out(out_t, 1);
  CHECK_EQ(Run(in, out), std::string());
  return out.Get(0);
}

void TestArithmetic() {
  // No FMA: w1 * y1 = 1 + 2^-22 + 2^-46 rounds to 1 + 2^-22 before the add,
  // so the sum is exactly 0 (a fused multiply-add would give 2^-46).
  const float e = std::ldexp(1.0f, -23);
  CHECK_EQ(Bits(RunOne(Manual({-1.0f, 1.0f + e}, {1.0f + 2 * e, 1.0f + e}))),
           Bits(0.0f));
  // k order: (1e8 + 1) - 1e8 = 0 in float32, (1e8 - 1e8) + 1 = 1.
  CHECK_EQ(RunOne(Manual({1, 1, 1}, {1e8f, 1.0f, -1e8f})), 0.0f);
  CHECK_EQ(RunOne(Manual({1, 1, 1}, {1e8f, -1e8f, 1.0f})), 1.0f);
  // acc starts at +0.0: -0.0 products give +0.0.
  CHECK_EQ(Bits(RunOne(Manual({-1.0f}, {0.0f}))), Bits(0.0f));
  CHECK_EQ(Bits(RunOne(Manual({1.0f, -1.0f}, {-0.0f, 0.0f}))), Bits(0.0f));
  // NaN and inf propagate.
  CHECK(std::isnan(RunOne(Manual({1.0f, 1.0f}, {NAN, 1.0f}))));
  CHECK(std::isnan(RunOne(Manual({1.0f, 1.0f}, {INFINITY, -INFINITY}))));
  CHECK(std::isnan(RunOne(Manual({0.0f}, {INFINITY}))));
  CHECK(std::isnan(RunOne(Manual({1.0f}, {NAN}), FloatType::kBF16)));
  CHECK(std::isnan(RunOne(Manual({1.0f}, {NAN}), FloatType::kF16)));
  // bf16 output: ties to even. 1 + 2^-8 is halfway between bf16 1 and
  // 1 + 2^-7: rounds to 1; 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
  CHECK_EQ(RunOne(Manual({1.0f}, {1.0f + std::ldexp(1.0f, -8)}), FloatType::kBF16), 1.0f);
  CHECK_EQ(RunOne(Manual({1.0f}, {1.0f + 3 * std::ldexp(1.0f, -8)}), FloatType::kBF16),
           1.0f + std::ldexp(1.0f, -6));
  // f16 output: ties to even, overflow to inf.
  CHECK_EQ(RunOne(Manual({1.0f}, {1.0f + std::ldexp(1.0f, -11)}), FloatType::kF16), 1.0f);
  CHECK_EQ(RunOne(Manual({1.0f}, {65520.0f}), FloatType::kF16), INFINITY);
  CHECK_EQ(RunOne(Manual({2.0f}, {40000.0f}), FloatType::kF16), INFINITY);
  // bf16 / f16 inputs are widened exactly.
  CHECK_EQ(RunOne(Manual({0.5f}, {3.0f}, FloatType::kBF16)), 1.5f);
  CHECK_EQ(RunOne(Manual({1.0f}, {std::ldexp(1.0f, -24)}, FloatType::kF16)),
           std::ldexp(1.0f, -24));
  // The float32 accumulator keeps bits a bf16 accumulator would lose.
  CHECK_EQ(RunOne(Manual({1, 1}, {256.0f, 1.0f}, FloatType::kBF16)), 257.0f);
}

void TestAbsentAndErrors() {
  // Token 0: slot 0 in cap, slot 1 before the windows, slot 2 in spill,
  // slot 3 after the windows (with a bogus dest, never read).
  Inputs in;
  in.P = 2;
  in.C = 2;
  in.S = 1;
  in.H = 1;
  in.T = 1;
  in.k = 4;
  in.start = 1;
  in.cap = Array(FloatType::kF32, 4);
  in.spill = Array(FloatType::kF32, 2);
  const float cap_vals[] = {10, 20, 30, 40}, spill_vals[] = {100, 200};
  for (int i = 0; i < 4; ++i) in.cap.Set(i, cap_vals[i]);
  for (int i = 0; i < 2; ++i) in.spill.Set(i, spill_vals[i]);
  in.dest = {1, 0, 1, 77};
  in.pos = {2, 0, 3, 4};  // q = 1 (cap[1][1]=40), -1, 2 (spill[1][0]=200), 3
  in.weights = {1.0f, 1000.0f, 0.5f, 1000.0f};
  CHECK_EQ(RunOne(in), 40.0f + 100.0f);
  CheckAgainstReference(in, FloatType::kF32);

  Inputs bad = in;
  bad.dest[0] = 2;  // present slot, dest out of range
  Array out(FloatType::kF32, 1);
  CHECK_CONTAINS(Run(bad, out), "dest[0] = 2 is outside [0, P=2)");
  bad = in;
  bad.dest[2] = -1;
  CHECK_CONTAINS(Run(bad, out), "dest[2] = -1");
  bad = in;
  bad.start = -1;
  CHECK_CONTAINS(Run(bad, out), "start");
  bad = in;
  bad.k = 0;
  CHECK_CONTAINS(Run(bad, out), "top_k");
  // A huge start makes every slot absent: zeros, no overflow.
  bad = in;
  bad.start = int64_t(1) << 62;
  CHECK_EQ(Bits(RunOne(bad)), Bits(0.0f));
  // T = 0 and H = 0 are fine.
  bad = in;
  bad.T = 0;
  Array none(FloatType::kBF16, 0);
  CHECK_EQ(Run(bad, none), std::string());
}

}  // namespace

int main() {
  TestRandom();
  TestArithmetic();
  TestAbsentAndErrors();
  return moe_jax_test::Report("test_combine");
}

// Standalone check of the CUDA pack and combine kernels against a CPU
// reference written from docs/design/custom_calls.md. Outputs are poisoned
// before each launch and surrounded by guard bytes; results must match the
// reference bit for bit. Exits 0 with a message when no GPU is present.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "pack_combine.h"
#include "cuda_check.h"

using moe_jax::cuda::CombineArgs;
using moe_jax::cuda::ElemType;
using moe_jax::cuda::PackArgs;

namespace {

constexpr unsigned char kPoison = 0xA5;
constexpr size_t kGuard = 64;

// ---- Host conversions (IEEE, round to nearest even; NaN not produced) ----

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float Bf16ToF32(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

uint16_t F32ToBf16(float f) {
  const uint32_t x = Bits(f);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return FromBits(sign | 0x7F800000u | (mant << 13));
  return FromBits(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t F32ToF16(float f) {
  const uint32_t x = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x477FF000u) return sign | 0x7C00u;  // rounds to infinity
  if (ax < 0x38800000u) {                       // half subnormal or zero
    // |f| * 2^24 is exact; nearbyint rounds half to even.
    return sign | static_cast<uint16_t>(std::nearbyint(std::fabs(f) * 16777216.0f));
  }
  const uint32_t r = ax + 0xFFFu + ((ax >> 13) & 1u);
  return sign | static_cast<uint16_t>((r >> 13) - (112u << 10));
}

int Bytes(ElemType t) { return moe_jax::cuda::ElemBytes(t); }
const char* Name(ElemType t) {
  return t == ElemType::kF32 ? "f32" : t == ElemType::kBF16 ? "bf16" : "f16";
}

float LoadElem(const unsigned char* p, ElemType t) {
  if (t == ElemType::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t == ElemType::kBF16 ? Bf16ToF32(h) : F16ToF32(h);
}

void StoreElem(unsigned char* p, ElemType t, float v) {
  if (t == ElemType::kF32) {
    std::memcpy(p, &v, 4);
    return;
  }
  const uint16_t h = t == ElemType::kBF16 ? F32ToBf16(v) : F32ToF16(v);
  std::memcpy(p, &h, 2);
}

// ---- Dispatch plan (as the router would build it) ----

struct Plan {
  int64_t T, k, P;
  std::vector<int32_t> sorted_slots, send_offsets, send_counts, dest, pos;
};

Plan MakePlan(std::mt19937_64& rng, int64_t T, int64_t k, int64_t P, int64_t e_local) {
  Plan plan{T, k, P, {}, {}, {}, {}, {}};
  const int64_t N = T * k;
  const int64_t E = P * e_local;
  // Skewed expert choice so some ranks overflow and some get nothing.
  std::vector<int32_t> expert(N);
  const int64_t hot = std::uniform_int_distribution<int64_t>(0, E - 1)(rng);
  for (int64_t n = 0; n < N; ++n) {
    expert[n] = static_cast<int32_t>(
        rng() % 3 == 0 ? hot : std::uniform_int_distribution<int64_t>(0, E - 1)(rng));
  }
  // Stable argsort by expert id (counting sort keeps slot order).
  std::vector<std::vector<int32_t>> by_expert(E);
  for (int64_t n = 0; n < N; ++n) by_expert[expert[n]].push_back(static_cast<int32_t>(n));
  for (const auto& v : by_expert) {
    for (int32_t n : v) plan.sorted_slots.push_back(n);
  }
  plan.send_counts.assign(P, 0);
  plan.send_offsets.assign(P, 0);
  plan.dest.resize(N);
  plan.pos.resize(N);
  for (int64_t n = 0; n < N; ++n) plan.send_counts[expert[n] / e_local]++;
  for (int64_t p = 1; p < P; ++p) {
    plan.send_offsets[p] = plan.send_offsets[p - 1] + plan.send_counts[p - 1];
  }
  for (int64_t i = 0; i < N; ++i) {
    const int32_t n = plan.sorted_slots[i];
    const int32_t p = static_cast<int32_t>(expert[n] / e_local);
    plan.dest[n] = p;
    plan.pos[n] = static_cast<int32_t>(i - plan.send_offsets[p]);
  }
  return plan;
}

// ---- Device buffers with guard bytes and chosen misalignment ----

struct DevBuf {
  unsigned char* base = nullptr;
  size_t bytes = 0, offset = 0;
  unsigned char* ptr() const { return base + kGuard + offset; }
  size_t total() const { return kGuard + offset + bytes + kGuard; }
};

DevBuf Alloc(size_t bytes, size_t offset) {
  DevBuf b;
  b.bytes = bytes;
  b.offset = offset;
  CUDA_CHECK(cudaMalloc(&b.base, b.total()));
  CUDA_CHECK(cudaMemset(b.base, kPoison, b.total()));
  return b;
}

DevBuf Upload(const void* host, size_t bytes, size_t offset) {
  DevBuf b = Alloc(bytes, offset);
  if (bytes) CUDA_CHECK(cudaMemcpy(b.ptr(), host, bytes, cudaMemcpyHostToDevice));
  return b;
}

void Free(DevBuf& b) {
  CUDA_CHECK(cudaFree(b.base));
  b.base = nullptr;
}

// Compares an output against the reference and checks the guard bytes.
bool CheckOutput(const DevBuf& b, const std::vector<unsigned char>& want,
                 const std::string& what) {
  std::vector<unsigned char> all(b.total());
  CUDA_CHECK(cudaMemcpy(all.data(), b.base, all.size(), cudaMemcpyDeviceToHost));
  const size_t lo = kGuard + b.offset;
  for (size_t i = 0; i < all.size(); ++i) {
    if (i >= lo && i < lo + b.bytes) continue;
    if (all[i] != kPoison) {
      std::fprintf(stderr, "FAIL %s: byte %zd outside the output was written\n",
                   what.c_str(), static_cast<ptrdiff_t>(i) - static_cast<ptrdiff_t>(lo));
      return false;
    }
  }
  CHECK(want.size() == b.bytes);
  for (size_t i = 0; i < b.bytes; ++i) {
    if (all[lo + i] != want[i]) {
      std::fprintf(stderr, "FAIL %s: byte %zu is 0x%02x, want 0x%02x\n", what.c_str(),
                   i, all[lo + i], want[i]);
      return false;
    }
  }
  return true;
}

size_t PickOffset(std::mt19937_64& rng, int itemsize) {
  switch (rng() % 6) {
    case 0: return itemsize;
    case 1: return 2 * itemsize;
    case 2: return 8;
    default: return 0;
  }
}

// ---- moe_jax_pack ----

struct PackCase {
  ElemType type;
  int64_t T, H, k, P, e_local, start, capacity, spill;
};

bool RunPack(std::mt19937_64& rng, const PackCase& c, bool misalign,
             cudaStream_t stream) {
  const Plan plan = MakePlan(rng, c.T, c.k, c.P, c.e_local);
  const int64_t N = c.T * c.k;
  const int64_t row = c.H * Bytes(c.type);
  std::vector<unsigned char> x(c.T * row);
  for (auto& b : x) b = static_cast<unsigned char>(rng());  // any bit pattern

  // Reference, straight from the spec.
  auto ref = [&](int64_t rows, int64_t first) {
    std::vector<unsigned char> buf(c.P * rows * row, 0);
    for (int64_t p = 0; p < c.P; ++p) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t s = first + r;
        if (s < plan.send_counts[p]) {
          const int64_t t = plan.sorted_slots[plan.send_offsets[p] + s] / c.k;
          std::memcpy(&buf[(p * rows + r) * row], &x[t * row], row);
        }
      }
    }
    return buf;
  };
  const auto want_cap = ref(c.capacity, c.start);
  const auto want_spill = ref(c.spill, c.start + c.capacity);

  const int isz = Bytes(c.type);
  DevBuf dx = Upload(x.data(), x.size(), misalign ? PickOffset(rng, isz) : 0);
  DevBuf dslots = Upload(plan.sorted_slots.data(), N * 4, 0);
  DevBuf doff = Upload(plan.send_offsets.data(), c.P * 4, 0);
  DevBuf dcnt = Upload(plan.send_counts.data(), c.P * 4, 0);
  DevBuf dcap = Alloc(want_cap.size(), misalign ? PickOffset(rng, isz) : 0);
  DevBuf dspill = Alloc(want_spill.size(), misalign ? PickOffset(rng, isz) : 0);

  PackArgs a;
  a.x = dx.ptr();
  a.sorted_slots = reinterpret_cast<const int32_t*>(dslots.ptr());
  a.send_offsets = reinterpret_cast<const int32_t*>(doff.ptr());
  a.send_counts = reinterpret_cast<const int32_t*>(dcnt.ptr());
  a.cap_buf = dcap.ptr();
  a.spill_buf = dspill.ptr();
  a.num_tokens = c.T;
  a.num_slots = N;
  a.num_ranks = c.P;
  a.row_bytes = row;
  a.top_k = c.k;
  a.start = c.start;
  a.capacity = c.capacity;
  a.spill_capacity = c.spill;
  CUDA_CHECK(moe_jax::cuda::LaunchPack(a, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));

  char what[256];
  std::snprintf(what, sizeof what,
                "pack %s T=%lld H=%lld k=%lld P=%lld start=%lld cap=%lld spill=%lld "
                "offsets=%zu/%zu/%zu",
                Name(c.type), (long long)c.T, (long long)c.H, (long long)c.k,
                (long long)c.P, (long long)c.start, (long long)c.capacity,
                (long long)c.spill, dx.offset, dcap.offset, dspill.offset);
  const bool ok = CheckOutput(dcap, want_cap, std::string(what) + " cap_buf") &&
                  CheckOutput(dspill, want_spill, std::string(what) + " spill_buf");
  for (DevBuf* b : {&dx, &dslots, &doff, &dcnt, &dcap, &dspill}) Free(*b);
  return ok;
}

// ---- moe_jax_combine ----

struct CombineCase {
  ElemType in, out;
  int64_t T, H, k, P, e_local, start, C, S;
};

// A value of moderate range with varied exponents, zeros and subnormals.
float RandomValue(std::mt19937_64& rng, ElemType t) {
  const uint64_t r = rng();
  if (r % 29 == 0) return (r & 64) ? -0.0f : 0.0f;
  const int lo = t == ElemType::kF32 ? -30 : -24;
  const int hi = t == ElemType::kF32 ? 17 : 10;
  const int e = lo + static_cast<int>((r >> 8) % (hi - lo + 1));
  const float m = 1.0f + static_cast<float>((r >> 20) & 0xFFFFFF) / 16777216.0f;
  const float v = std::ldexp(m, e) * ((r & 1) ? -1.0f : 1.0f);
  if (t == ElemType::kBF16) return Bf16ToF32(F32ToBf16(v));
  if (t == ElemType::kF16) return F16ToF32(F32ToF16(v));
  return v;
}

float RandomWeight(std::mt19937_64& rng) {
  const uint64_t r = rng();
  switch (r % 16) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: return 1.0f;
    case 3: return 1e-40f;  // subnormal: must not be flushed
    case 4: return -std::ldexp(static_cast<float>((r >> 8) & 0xFFFF), -16);
    default: return std::ldexp(static_cast<float>((r >> 8) & 0xFFFFFF), -24);
  }
}

bool RunCombine(std::mt19937_64& rng, const CombineCase& c, bool misalign,
                cudaStream_t stream) {
  const Plan plan = MakePlan(rng, c.T, c.k, c.P, c.e_local);
  const int64_t N = c.T * c.k;
  const int ib = Bytes(c.in), ob = Bytes(c.out);
  std::vector<unsigned char> cap(c.P * c.C * c.H * ib), spill(c.P * c.S * c.H * ib);
  for (size_t i = 0; i < cap.size() / ib; ++i) StoreElem(&cap[i * ib], c.in, RandomValue(rng, c.in));
  for (size_t i = 0; i < spill.size() / ib; ++i) StoreElem(&spill[i * ib], c.in, RandomValue(rng, c.in));
  std::vector<float> w(N);
  for (auto& v : w) v = RandomWeight(rng);

  // Reference, straight from the spec (built with -ffp-contract=off).
  std::vector<unsigned char> want(c.T * c.H * ob);
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t h = 0; h < c.H; ++h) {
      float acc = 0.0f;
      for (int64_t j = 0; j < c.k; ++j) {
        const int64_t n = t * c.k + j;
        const int64_t d = plan.dest[n];
        const int64_t q = plan.pos[n] - c.start;
        const unsigned char* y = nullptr;
        if (q >= 0 && q < c.C) {
          y = &cap[((d * c.C + q) * c.H + h) * ib];
        } else if (q >= c.C && q < c.C + c.S) {
          y = &spill[((d * c.S + q - c.C) * c.H + h) * ib];
        }
        const float prod = y ? w[n] * LoadElem(y, c.in) : 0.0f;
        acc = acc + prod;
      }
      StoreElem(&want[(t * c.H + h) * ob], c.out, acc);
    }
  }

  DevBuf dcap = Upload(cap.data(), cap.size(), misalign ? PickOffset(rng, ib) : 0);
  DevBuf dspill = Upload(spill.data(), spill.size(), misalign ? PickOffset(rng, ib) : 0);
  DevBuf ddest = Upload(plan.dest.data(), N * 4, 0);
  DevBuf dpos = Upload(plan.pos.data(), N * 4, 0);
  DevBuf dw = Upload(w.data(), N * 4, 0);
  DevBuf dout = Alloc(want.size(), misalign ? PickOffset(rng, ob) : 0);

  CombineArgs a;
  a.cap_ret = dcap.ptr();
  a.spill_ret = dspill.ptr();
  a.dest = reinterpret_cast<const int32_t*>(ddest.ptr());
  a.pos = reinterpret_cast<const int32_t*>(dpos.ptr());
  a.weights = reinterpret_cast<const float*>(dw.ptr());
  a.out = dout.ptr();
  a.num_tokens = c.T;
  a.hidden = c.H;
  a.top_k = c.k;
  a.num_ranks = c.P;
  a.cap_rows = c.C;
  a.spill_rows = c.S;
  a.start = c.start;
  CUDA_CHECK(moe_jax::cuda::LaunchCombine(a, c.in, c.out, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));

  char what[256];
  std::snprintf(what, sizeof what,
                "combine %s->%s T=%lld H=%lld k=%lld P=%lld start=%lld C=%lld S=%lld "
                "offsets=%zu/%zu/%zu",
                Name(c.in), Name(c.out), (long long)c.T, (long long)c.H, (long long)c.k,
                (long long)c.P, (long long)c.start, (long long)c.C, (long long)c.S,
                dcap.offset, dspill.offset, dout.offset);
  const bool ok = CheckOutput(dout, want, what);
  for (DevBuf* b : {&dcap, &dspill, &ddest, &dpos, &dw, &dout}) Free(*b);
  return ok;
}

int64_t Pick(std::mt19937_64& rng, std::initializer_list<int64_t> v) {
  return *(v.begin() + rng() % v.size());
}

}  // namespace

int main() {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("pack_combine_cuda_test: SKIPPED, no CUDA GPU (%s)\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    return 0;
  }
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::mt19937_64 rng(20240611);
  int passed = 0, failed = 0;
  auto count = [&](bool ok) { ok ? ++passed : ++failed; };
  const ElemType types[] = {ElemType::kF32, ElemType::kBF16, ElemType::kF16};

  // Hand-picked pack cases: empty buffers, windows past every stream, odd H.
  for (ElemType t : types) {
    count(RunPack(rng, {t, 0, 8, 2, 4, 2, 0, 3, 2}, false, stream));
    count(RunPack(rng, {t, 5, 8, 2, 4, 2, 0, 0, 0}, false, stream));
    count(RunPack(rng, {t, 5, 0, 2, 4, 2, 0, 3, 2}, false, stream));
    count(RunPack(rng, {t, 9, 3, 2, 2, 1, 100, 4, 4}, false, stream));
    count(RunPack(rng, {t, 64, 7168, 8, 8, 4, 0, 40, 24}, false, stream));
    count(RunPack(rng, {t, 33, 1, 3, 3, 2, 2, 5, 7}, true, stream));
  }
  // Random pack cases.
  for (int i = 0; i < 240; ++i) {
    PackCase c;
    c.type = types[rng() % 3];
    c.T = Pick(rng, {1, 2, 7, 31, 64, 200});
    c.H = Pick(rng, {1, 2, 3, 4, 5, 8, 12, 16, 33, 64, 130, 1000, 1024, 2056});
    c.k = Pick(rng, {1, 2, 3, 4, 8});
    c.P = Pick(rng, {1, 2, 3, 4, 8});
    c.e_local = Pick(rng, {1, 2, 4});
    const int64_t per_rank = (c.T * c.k + c.P - 1) / c.P;
    c.start = rng() % 2 ? 0 : rng() % (per_rank + 2);
    c.capacity = rng() % (per_rank + 2);
    c.spill = rng() % 4 == 0 ? 0 : rng() % (per_rank + 2);
    count(RunPack(rng, c, rng() % 2 == 0, stream));
  }

  // Hand-picked combine cases.
  for (ElemType in : types) {
    for (ElemType out : types) {
      count(RunCombine(rng, {in, out, 0, 8, 2, 2, 2, 0, 4, 4}, false, stream));
      count(RunCombine(rng, {in, out, 6, 8, 2, 2, 2, 0, 0, 0}, false, stream));
      count(RunCombine(rng, {in, out, 6, 0, 2, 2, 2, 0, 4, 4}, false, stream));
      count(RunCombine(rng, {in, out, 64, 4096, 8, 8, 4, 0, 40, 24}, false, stream));
      count(RunCombine(rng, {in, out, 17, 7168, 6, 4, 2, 3, 20, 6}, true, stream));
      count(RunCombine(rng, {in, out, 9, 64, 40, 4, 2, 1, 60, 50}, false, stream));  // k > 32
      count(RunCombine(rng, {in, out, 5, 5, 3, 2, 1, 0, 3, 2}, true, stream));
      count(RunCombine(rng, {in, out, 3, 4099, 2, 2, 1, 0, 3, 3}, false, stream));  // H split in spans
      count(RunCombine(rng, {in, out, 1, 8192, 8, 4, 2, 0, 2, 1}, true, stream));
    }
  }
  // Random combine cases.
  for (int i = 0; i < 300; ++i) {
    CombineCase c;
    c.in = types[rng() % 3];
    c.out = types[rng() % 3];
    c.T = Pick(rng, {1, 2, 7, 31, 64, 150});
    c.H = Pick(rng, {1, 2, 3, 4, 6, 8, 12, 16, 24, 33, 64, 130, 1000, 1024, 2056, 4100, 8192});
    c.k = Pick(rng, {1, 2, 3, 4, 6, 8});
    c.P = Pick(rng, {1, 2, 3, 4, 8});
    c.e_local = Pick(rng, {1, 2, 4});
    const int64_t per_rank = (c.T * c.k + c.P - 1) / c.P;
    c.start = rng() % 2 ? 0 : rng() % (per_rank + 2);
    c.C = rng() % (per_rank + 2);
    c.S = rng() % 4 == 0 ? 0 : rng() % (per_rank + 2);
    count(RunCombine(rng, c, rng() % 2 == 0, stream));
  }

  CUDA_CHECK(cudaStreamDestroy(stream));
  std::printf("pack_combine_cuda_test: %d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

// Standalone check of the grouped GEMM (LaunchGroupedGemm) against a CPU
// reference in double precision: every op and input dtype, group sizes with
// empty groups, one group holding every row, negative sizes, sizes past M and
// padding rows, M of 0 and M not a multiple of the tile. Outputs are
// poisoned (NaN) before each launch; rows no group covers must come back
// +0.0. Rows must be bitwise the same in calls on fewer rows, and a CUDA
// graph captured once must give the direct launches' bits when replayed with
// other group sizes and inputs. Exits 0 with a message when no Hopper GPU is
// present.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "cuda_check.h"
#include "grouped_gemm.h"

using moe_jax::cuda::GemmElem;
using moe_jax::cuda::GroupedGemmArgs;
using moe_jax::cuda::GroupedGemmOp;

namespace {

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

// Round to nearest even; inputs here are finite and far from overflow.
uint16_t ToBf16(float f) {
  const uint32_t u = Bits(f);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
float FromBf16(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

uint16_t ToF16(float f) {
  // Normal range only (test data are O(1)); round to nearest even.
  const uint32_t u = Bits(f);
  const uint32_t sign = (u >> 16) & 0x8000;
  const int exp = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
  if (exp <= 0) return static_cast<uint16_t>(sign | 1);  // tiny: the smallest subnormal, not 0
  uint32_t mant = u & 0x7FFFFF;
  uint32_t h = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return static_cast<uint16_t>(h);
}
float FromF16(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const int exp = (h >> 10) & 0x1F;
  const uint32_t mant = h & 0x3FF;
  if (exp == 0) {  // zero or subnormal
    const float magnitude = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -magnitude : magnitude;
  }
  return FromBits(sign | static_cast<uint32_t>(exp - 15 + 127) << 23 | mant << 13);
}

struct Elem {
  GemmElem type;
  size_t bytes() const { return type == GemmElem::kF32 ? 4 : 2; }
  uint16_t Encode16(float f) const { return type == GemmElem::kBF16 ? ToBf16(f) : ToF16(f); }
  double Read(const std::vector<uint8_t>& buf, size_t i) const {
    if (type == GemmElem::kF32) {
      float f;
      std::memcpy(&f, buf.data() + 4 * i, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, buf.data() + 2 * i, 2);
    return type == GemmElem::kBF16 ? FromBf16(h) : FromF16(h);
  }
  // Unit roundoff of the output rounding.
  double Eps() const {
    return type == GemmElem::kF32 ? 0.0 : type == GemmElem::kBF16 ? 1.0 / 256 : 1.0 / 2048;
  }
};

// A host matrix of 16-bit values and their float values.
struct HostInput {
  std::vector<uint16_t> raw;
  std::vector<double> value;
};

HostInput RandomInput(std::mt19937& rng, size_t count, GemmElem type) {
  std::normal_distribution<float> normal(0.f, 1.f);
  HostInput in;
  in.raw.resize(count);
  in.value.resize(count);
  const Elem e{type};
  for (size_t i = 0; i < count; ++i) {
    float f = normal(rng);
    if (f == 0.f) f = 0.5f;  // never zeros
    in.raw[i] = e.Encode16(f);
    in.value[i] = type == GemmElem::kBF16 ? FromBf16(in.raw[i]) : FromF16(in.raw[i]);
  }
  return in;
}

template <class T>
T* ToDevice(const std::vector<T>& v) {
  T* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(1, v.size()) * sizeof(T)));
  if (!v.empty()) CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

// [begin, end) of each group: sizes clamped at 0, cut to [0, M).
std::vector<std::pair<int64_t, int64_t>> GroupRanges(const std::vector<int32_t>& sizes,
                                                     int64_t rows) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t at = 0;
  for (int32_t s : sizes) {
    const int64_t begin = std::min(at, rows);
    const int64_t end = std::min(at + std::max<int64_t>(s, 0), rows);
    out.emplace_back(begin, end);
    at += std::max<int64_t>(s, 0);
  }
  return out;
}

struct Case {
  GroupedGemmOp op;
  GemmElem in, out;
  std::vector<int32_t> sizes;
  int64_t rows, k, n;
};

std::string Name(const Case& c) {
  const char* ops[] = {"forward", "swiglu", "transposed", "weight_grad"};
  const char* types[] = {"bf16", "f16", "f32"};
  std::string s = std::string(ops[static_cast<int>(c.op)]) + " " +
                  types[static_cast<int>(c.in)] + "->" + types[static_cast<int>(c.out)] +
                  " M=" + std::to_string(c.rows) + " K=" + std::to_string(c.k) +
                  " N=" + std::to_string(c.n) + " sizes=[";
  for (size_t i = 0; i < c.sizes.size(); ++i) s += (i ? "," : "") + std::to_string(c.sizes[i]);
  return s + "]";
}

// Shapes of a, b and out (element counts) for a case.
struct Shapes {
  int64_t a, b, out, out_rows, out_cols;
};
Shapes ShapesOf(const Case& c) {
  const int64_t G = static_cast<int64_t>(c.sizes.size());
  switch (c.op) {
    case GroupedGemmOp::kForward:
      return {c.rows * c.k, G * c.k * c.n, c.rows * c.n, c.rows, c.n};
    case GroupedGemmOp::kForwardSwiGLU:
      return {c.rows * c.k, G * c.k * c.n, c.rows * c.n / 2, c.rows, c.n / 2};
    case GroupedGemmOp::kTransposedB:
      return {c.rows * c.n, G * c.k * c.n, c.rows * c.k, c.rows, c.k};
    case GroupedGemmOp::kWeightGrad:
      return {c.rows * c.k, c.rows * c.n, G * c.k * c.n, G * c.k, c.n};
  }
  return {};
}

// The reference: out values and |a| @ |b| (for the tolerance), in double.
void Reference(const Case& c, const HostInput& a, const HostInput& b, std::vector<double>* ref,
               std::vector<double>* mag) {
  const Shapes s = ShapesOf(c);
  ref->assign(s.out, 0.0);
  mag->assign(s.out, 0.0);
  const auto ranges = GroupRanges(c.sizes, c.rows);
  const int64_t K = c.k, N = c.n;
  for (size_t g = 0; g < ranges.size(); ++g) {
    const auto [begin, end] = ranges[g];
    if (c.op == GroupedGemmOp::kWeightGrad) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < N; ++j) {
            const double x = a.value[r * K + i], y = b.value[r * N + j];
            (*ref)[(g * K + i) * N + j] += x * y;
            (*mag)[(g * K + i) * N + j] += std::fabs(x * y);
          }
      continue;
    }
    for (int64_t r = begin; r < end; ++r) {
      if (c.op == GroupedGemmOp::kTransposedB) {
        for (int64_t i = 0; i < K; ++i) {
          double acc = 0, m = 0;
          for (int64_t j = 0; j < N; ++j) {
            const double p = a.value[r * N + j] * b.value[(g * K + i) * N + j];
            acc += p;
            m += std::fabs(p);
          }
          (*ref)[r * K + i] = acc;
          (*mag)[r * K + i] = m;
        }
        continue;
      }
      std::vector<double> h(N, 0.0), hm(N, 0.0);
      for (int64_t i = 0; i < K; ++i) {
        const double x = a.value[r * K + i];
        for (int64_t j = 0; j < N; ++j) {
          const double p = x * b.value[(g * K + i) * N + j];
          h[j] += p;
          hm[j] += std::fabs(p);
        }
      }
      if (c.op == GroupedGemmOp::kForward) {
        for (int64_t j = 0; j < N; ++j) {
          (*ref)[r * N + j] = h[j];
          (*mag)[r * N + j] = hm[j];
        }
        continue;
      }
      const int64_t F = N / 2, B = moe_jax::cuda::kSwiGLUBlock;
      for (int64_t f = 0; f < F; ++f) {
        const int64_t gate = (f / B) * 2 * B + f % B, up = gate + B;
        const double sig = 1.0 / (1.0 + std::exp(-h[gate]));
        (*ref)[r * F + f] = h[gate] * sig * h[up];
        // Sensitivity of silu(g) * u to relative errors in g and u.
        (*mag)[r * F + f] = (std::fabs(sig * h[up]) * 1.2 * hm[gate] + std::fabs(h[gate] * sig) * hm[up]);
      }
    }
  }
}

struct Run {
  std::vector<uint8_t> out;
};

GroupedGemmArgs ArgsFor(const Case& c, const void* a, const void* b, const int32_t* sizes,
                        void* out, void* ws) {
  GroupedGemmArgs args;
  args.op = c.op;
  args.in_type = c.in;
  args.out_type = c.out;
  args.a = a;
  args.b = b;
  args.group_sizes = sizes;
  args.out = out;
  args.rows = c.rows;
  args.k = c.k;
  args.n = c.n;
  args.groups = static_cast<int64_t>(c.sizes.size());
  args.workspace = ws;
  args.workspace_bytes = moe_jax::cuda::GroupedGemmWorkspaceBytes(args.groups);
  return args;
}

// Runs a case on poisoned output; returns the output bytes.
std::vector<uint8_t> Launch(const Case& c, const HostInput& a, const HostInput& b) {
  const Shapes s = ShapesOf(c);
  const Elem oe{c.out};
  auto* da = ToDevice(a.raw);
  auto* db = ToDevice(b.raw);
  auto* dsizes = ToDevice(c.sizes);
  void* dout = nullptr;
  void* ws = nullptr;
  const size_t out_bytes = std::max<size_t>(1, s.out * oe.bytes());
  CUDA_CHECK(cudaMalloc(&dout, out_bytes));
  CUDA_CHECK(cudaMemset(dout, 0xFF, out_bytes));  // NaN in every dtype
  const size_t ws_bytes = moe_jax::cuda::GroupedGemmWorkspaceBytes(c.sizes.size());
  CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  CUDA_CHECK(cudaMemset(ws, 0xFF, ws_bytes));
  const std::string err =
      moe_jax::cuda::LaunchGroupedGemm(ArgsFor(c, da, db, dsizes, dout, ws), nullptr);
  CHECK(err.empty(), "%s: %s", Name(c).c_str(), err.c_str());
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> out(s.out * oe.bytes());
  if (!out.empty()) CUDA_CHECK(cudaMemcpy(out.data(), dout, out.size(), cudaMemcpyDeviceToHost));
  cudaFree(da);
  cudaFree(db);
  cudaFree(dsizes);
  cudaFree(dout);
  cudaFree(ws);
  return out;
}

void CheckAgainstReference(const Case& c, std::mt19937& rng) {
  const Shapes s = ShapesOf(c);
  const HostInput a = RandomInput(rng, s.a, c.in);
  const HostInput b = RandomInput(rng, s.b, c.in);
  const std::vector<uint8_t> out = Launch(c, a, b);
  std::vector<double> ref, mag;
  Reference(c, a, b, &ref, &mag);
  const Elem oe{c.out};
  // float32 sums of K products in any order, then the output rounding.
  const int64_t depth = c.op == GroupedGemmOp::kTransposedB ? c.n
                        : c.op == GroupedGemmOp::kWeightGrad ? c.rows
                                                             : c.k;
  const double sum_eps = (depth + 16) * std::ldexp(1.0, -22);
  std::vector<bool> covered(s.out_rows, c.op == GroupedGemmOp::kWeightGrad);
  if (c.op != GroupedGemmOp::kWeightGrad) {
    for (auto [begin, end] : GroupRanges(c.sizes, c.rows))
      for (int64_t r = begin; r < end; ++r) covered[r] = true;
  }
  for (int64_t r = 0; r < s.out_rows; ++r) {
    for (int64_t j = 0; j < s.out_cols; ++j) {
      const size_t i = r * s.out_cols + j;
      const double got = oe.Read(out, i);
      CHECK(std::isfinite(got), "%s: out[%lld, %lld] not written (NaN)", Name(c).c_str(),
            (long long)r, (long long)j);
      if (!covered[r]) {
        CHECK(got == 0.0 && !std::signbit(got), "%s: padding row %lld col %lld = %g, want +0",
              Name(c).c_str(), (long long)r, (long long)j, got);
        continue;
      }
      // f16 outputs below 2^-14 are subnormal: their spacing is 2^-24.
      const double floor = c.out == GemmElem::kF16 ? std::ldexp(1.0, -24) : 1e-30;
      const double tol = oe.Eps() * std::fabs(ref[i]) + sum_eps * mag[i] * 2 + floor;
      CHECK(std::fabs(got - ref[i]) <= tol, "%s: out[%lld, %lld] = %.9g, reference %.9g (tol %g)",
            Name(c).c_str(), (long long)r, (long long)j, got, ref[i], tol);
    }
  }
}

// Rows of a call on a subset of each group's rows equal the full call's bits.
void CheckRowInvariance(GroupedGemmOp op, GemmElem type, GemmElem out_type, std::mt19937& rng) {
  const std::vector<int32_t> sizes = {300, 0, 517, 1, 190};
  const int64_t rows = 1008 + 7, K = 256, N = op == GroupedGemmOp::kForwardSwiGLU ? 384 : 200;
  Case full{op, type, out_type, sizes, rows, K, N};
  const int64_t a_cols = op == GroupedGemmOp::kTransposedB ? N : K;
  const HostInput a = RandomInput(rng, rows * a_cols, type);
  const HostInput b = RandomInput(rng, sizes.size() * K * N, type);
  const std::vector<uint8_t> all = Launch(full, a, b);
  const Shapes fs = ShapesOf(full);
  const size_t row_bytes = fs.out_cols * Elem{out_type}.bytes();
  const auto ranges = GroupRanges(sizes, rows);
  std::uniform_real_distribution<double> coin(0, 1);
  for (int trial = 0; trial < 4; ++trial) {
    // Keep each row with probability 1/2, or a single row of group 2.
    std::vector<int32_t> sub_sizes(sizes.size(), 0);
    std::vector<int64_t> kept;
    for (size_t g = 0; g < ranges.size(); ++g) {
      for (int64_t r = ranges[g].first; r < ranges[g].second; ++r) {
        const bool keep = trial == 3 ? (g == 2 && r == ranges[g].first + 111) : coin(rng) < 0.5;
        if (keep) {
          kept.push_back(r);
          ++sub_sizes[g];
        }
      }
    }
    HostInput sub_a;
    for (int64_t r : kept) {
      sub_a.raw.insert(sub_a.raw.end(), a.raw.begin() + r * a_cols, a.raw.begin() + (r + 1) * a_cols);
      sub_a.value.insert(sub_a.value.end(), a.value.begin() + r * a_cols,
                         a.value.begin() + (r + 1) * a_cols);
    }
    Case sub{op, type, out_type, sub_sizes, static_cast<int64_t>(kept.size()), K, N};
    const std::vector<uint8_t> part = Launch(sub, sub_a, b);
    for (size_t i = 0; i < kept.size(); ++i) {
      CHECK(std::memcmp(part.data() + i * row_bytes, all.data() + kept[i] * row_bytes,
                        row_bytes) == 0,
            "row %lld differs between a call on %lld rows and one on %zu rows (%s)",
            (long long)kept[i], (long long)rows, kept.size(), Name(sub).c_str());
    }
  }
}

// One captured graph replayed with new group sizes and inputs written into
// the same device buffers gives the bits of direct launches.
void CheckGraphReplay(std::mt19937& rng) {
  const int64_t rows = 640, K = 128, N = 256, G = 4;
  Case c{GroupedGemmOp::kForwardSwiGLU, GemmElem::kBF16, GemmElem::kBF16, {0, 0, 0, 0}, rows, K, N};
  const Shapes s = ShapesOf(c);
  void *da, *db, *dout, *ws;
  int32_t* dsizes;
  CUDA_CHECK(cudaMalloc(&da, s.a * 2));
  CUDA_CHECK(cudaMalloc(&db, s.b * 2));
  CUDA_CHECK(cudaMalloc(&dout, s.out * 2));
  CUDA_CHECK(cudaMalloc(&dsizes, G * 4));
  const size_t ws_bytes = moe_jax::cuda::GroupedGemmWorkspaceBytes(G);
  CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const std::string err = moe_jax::cuda::LaunchGroupedGemm(
      ArgsFor(c, da, db, dsizes, dout, ws), stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(err.empty(), "capture: %s", err.c_str());
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const std::vector<std::vector<int32_t>> replays = {
      {100, 0, 300, 240}, {0, 640, 0, 0}, {7, 9, 0, 11}, {-3, 600, 100, 5}};
  for (const auto& sizes : replays) {
    c.sizes = sizes;
    const HostInput a = RandomInput(rng, s.a, GemmElem::kBF16);
    const HostInput b = RandomInput(rng, s.b, GemmElem::kBF16);
    CUDA_CHECK(cudaMemcpy(da, a.raw.data(), s.a * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db, b.raw.data(), s.b * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dsizes, sizes.data(), G * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(dout, 0xFF, s.out * 2));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<uint8_t> replayed(s.out * 2);
    CUDA_CHECK(cudaMemcpy(replayed.data(), dout, replayed.size(), cudaMemcpyDeviceToHost));
    const std::vector<uint8_t> direct = Launch(c, a, b);
    CHECK(replayed == direct, "graph replay differs from a direct launch (%s)", Name(c).c_str());
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(da);
  cudaFree(db);
  cudaFree(dout);
  cudaFree(dsizes);
  cudaFree(ws);
}

}  // namespace

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("grouped_gemm_cuda_test: no GPU, skipped\n");
    return 0;
  }
  if (const std::string err = moe_jax::cuda::GroupedGemmDeviceError(); !err.empty()) {
    std::printf("grouped_gemm_cuda_test: %s, skipped\n", err.c_str());
    return 0;
  }
  std::mt19937 rng(20261125);
  const std::vector<std::vector<int32_t>> size_sets = {
      {64},                      // one group, every row
      {0, 130, 0, 0},            // empty groups around one
      {5, 0, 129, 1, 255, 17},   // partial tiles, padding after
      {-4, 40, 0, 300},          // negative size counts as 0; sum past M cuts
      {0, 0},                    // no rows at all
  };
  const std::vector<int64_t> extra_rows = {0, 3, 11, -100, 9};
  int cases = 0;
  for (GemmElem in : {GemmElem::kBF16, GemmElem::kF16}) {
    for (size_t i = 0; i < size_sets.size(); ++i) {
      int64_t sum = 0;
      for (int32_t s : size_sets[i]) sum += std::max(s, 0);
      const int64_t rows = std::max<int64_t>(0, sum + extra_rows[i]);
      const int64_t K = i % 2 ? 200 : 64, N = i % 2 ? 136 : 96;
      const std::vector<Case> cs = {
          {GroupedGemmOp::kForward, in, in, size_sets[i], rows, K, N},
          {GroupedGemmOp::kForward, in, GemmElem::kF32, size_sets[i], rows, K, N},
          {GroupedGemmOp::kForwardSwiGLU, in, in, size_sets[i], rows, K, 2 * N},
          {GroupedGemmOp::kTransposedB, in, in, size_sets[i], rows, K, N},
          {GroupedGemmOp::kWeightGrad, in, in, size_sets[i], rows, K, N},
      };
      for (const Case& c : cs) {
        CheckAgainstReference(c, rng);
        ++cases;
      }
    }
  }
  // A model-sized case: M not a multiple of the tile, K = 1024.
  CheckAgainstReference({GroupedGemmOp::kForwardSwiGLU, GemmElem::kBF16, GemmElem::kBF16,
                         {333, 0, 90, 600}, 1030, 1024, 512}, rng);
  // No rows at all: nothing to write, and an all-zero weight gradient.
  CheckAgainstReference({GroupedGemmOp::kForward, GemmElem::kBF16, GemmElem::kBF16,
                         {0, 0, 0}, 0, 64, 64}, rng);
  CheckAgainstReference({GroupedGemmOp::kWeightGrad, GemmElem::kBF16, GemmElem::kBF16,
                         {0, 0, 0}, 0, 64, 64}, rng);
  CheckAgainstReference({GroupedGemmOp::kWeightGrad, GemmElem::kBF16, GemmElem::kBF16,
                         {333, 0, 90, 600}, 1030, 256, 128}, rng);
  cases += 2;
  for (GemmElem in : {GemmElem::kBF16, GemmElem::kF16}) {
    CheckRowInvariance(GroupedGemmOp::kForward, in, in, rng);
    CheckRowInvariance(GroupedGemmOp::kForward, in, GemmElem::kF32, rng);
    CheckRowInvariance(GroupedGemmOp::kForwardSwiGLU, in, in, rng);
    CheckRowInvariance(GroupedGemmOp::kTransposedB, in, in, rng);
  }
  CheckGraphReplay(rng);
  std::printf("grouped_gemm_cuda_test: PASS (%d reference cases, row invariance, graph replay)\n",
              cases);
  return 0;
}

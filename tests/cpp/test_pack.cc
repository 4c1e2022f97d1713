// moe_jax_pack core: every output row is a row of x or zeros, exactly as the
// formula of docs/design/custom_calls.md says, for edge-case plans.
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tests/cpp/check.h"
#include "tests/cpp/plan.h"
#include "xla_ffi/pack_cpu.h"

namespace {

using moe_jax::cpu::Pack;
using moe_jax::cpu::PackArgs;
using moe_jax_test::MakePlan;
using moe_jax_test::Plan;

constexpr unsigned char kPoison = 0xAB;

struct Case {
  int64_t start = 0, capacity = 0, spill = 0;
  int64_t elem_bytes = 4;  // 4: f32 rows, 2: bf16/f16 rows
  int64_t H = 3;
};

// The spec's formula, one output row at a time.
std::vector<unsigned char> Expected(const Plan& p, const Case& c,
                                    const std::vector<unsigned char>& x,
                                    int64_t rows, int64_t first_pos) {
  const int64_t rb = c.H * c.elem_bytes;
  std::vector<unsigned char> out(p.P * rows * rb, 0);
  for (int64_t d = 0; d < p.P; ++d) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t sp = first_pos + r;
      if (sp < p.send_counts[d] && rb > 0) {
        const int64_t t = p.sorted_slots[p.send_offsets[d] + sp] / p.k;
        std::memcpy(&out[(d * rows + r) * rb], &x[t * rb], rb);
      }
    }
  }
  return out;
}

void RunCase(const Plan& p, const Case& c, std::mt19937& rng) {
  const int64_t rb = c.H * c.elem_bytes;
  std::vector<unsigned char> x(p.T * rb);
  for (auto& b : x) b = static_cast<unsigned char>(rng() % 251 + 1);  // nonzero
  std::vector<unsigned char> cap(p.P * c.capacity * rb, kPoison);
  std::vector<unsigned char> spill(p.P * c.spill * rb, kPoison);
  PackArgs a;
  a.x = x.data();
  a.num_tokens = p.T;
  a.row_bytes = rb;
  a.sorted_slots = p.sorted_slots.data();
  a.send_offsets = p.send_offsets.data();
  a.send_counts = p.send_counts.data();
  a.num_ranks = p.P;
  a.top_k = p.k;
  a.start = c.start;
  a.capacity = c.capacity;
  a.spill_capacity = c.spill;
  a.cap_buf = cap.data();
  a.spill_buf = spill.data();
  const std::string err = Pack(a);
  CHECK_EQ(err, std::string());
  CHECK(cap == Expected(p, c, x, c.capacity, c.start));
  CHECK(spill == Expected(p, c, x, c.spill, c.start + c.capacity));
}

void TestEdgeCases() {
  std::mt19937 rng(1);
  const Plan balanced = MakePlan(/*T=*/10, /*k=*/2, /*P=*/4, /*e_local=*/3, rng);
  const Plan k1 = MakePlan(9, 1, 3, 2, rng);
  const Plan one_dest = MakePlan(8, 2, 4, 2, rng, {0, 0, 1, 0});
  const Plan starved = MakePlan(12, 3, 4, 2, rng, {1, 0, 1, 1});  // rank 1 gets none
  const Plan k4 = MakePlan(5, 4, 2, 4, rng);
  const Plan single = MakePlan(6, 2, 1, 3, rng);  // P = 1
  const Plan empty = MakePlan(0, 2, 3, 2, rng);   // T = 0
  CHECK_EQ(one_dest.send_counts[2], 16);
  CHECK_EQ(starved.send_counts[1], 0);
  for (const Plan* p : {&balanced, &k1, &one_dest, &starved, &k4, &single, &empty}) {
    for (int64_t eb : {4, 2}) {
      RunCase(*p, {0, 0, 0, eb}, rng);        // both buffers empty
      RunCase(*p, {0, 0, 5, eb}, rng);        // capacity 0
      RunCase(*p, {0, 4, 0, eb}, rng);        // spill 0
      RunCase(*p, {0, 1, 1, eb}, rng);        // C = 1
      RunCase(*p, {0, 3, 2, eb}, rng);
      RunCase(*p, {2, 3, 2, eb}, rng);        // start > 0
      RunCase(*p, {1, 1, 100, eb}, rng);      // spill larger than any stream
      RunCase(*p, {3, 2, 1, eb}, rng);        // slots beyond both windows
      RunCase(*p, {100, 2, 2, eb}, rng);      // start beyond every stream
      RunCase(*p, {0, 64, 64, eb}, rng);      // everything fits in cap
      RunCase(*p, {0, 2, 3, eb, /*H=*/1}, rng);
      RunCase(*p, {1, 2, 3, eb, /*H=*/0}, rng);  // empty rows
    }
  }
  // Huge start attribute: no overflow, all zeros.
  RunCase(balanced, {int64_t(1) << 62, 2, 2, 4}, rng);
}

void TestRandom() {
  std::mt19937 rng(2);
  for (int i = 0; i < 300; ++i) {
    const int64_t T = rng() % 20, k = 1 + rng() % 4, P = 1 + rng() % 6;
    const Plan p = MakePlan(T, k, P, 1 + rng() % 3, rng);
    Case c;
    c.start = rng() % 5;
    c.capacity = rng() % 6;
    c.spill = rng() % 6;
    c.elem_bytes = (rng() % 2) ? 4 : 2;
    c.H = rng() % 5;
    RunCase(p, c, rng);
  }
}

PackArgs ArgsFor(const Plan& p, std::vector<unsigned char>& x,
                 std::vector<unsigned char>& cap,
                 std::vector<unsigned char>& spill) {
  PackArgs a;
  a.x = x.data();
  a.num_tokens = p.T;
  a.row_bytes = 4;
  a.sorted_slots = p.sorted_slots.data();
  a.send_offsets = p.send_offsets.data();
  a.send_counts = p.send_counts.data();
  a.num_ranks = p.P;
  a.top_k = p.k;
  a.capacity = 2;
  a.spill_capacity = 2;
  a.cap_buf = cap.data();
  a.spill_buf = spill.data();
  return a;
}

void TestErrors() {
  std::mt19937 rng(3);
  Plan p = MakePlan(4, 2, 2, 1, rng);
  std::vector<unsigned char> x(p.T * 4), cap(p.P * 2 * 4), spill(p.P * 2 * 4);

  Plan bad = p;
  bad.sorted_slots[bad.send_offsets[0]] = 8;  // N = 8
  if (bad.send_counts[0] == 0) bad.sorted_slots[bad.send_offsets[1]] = 8;
  CHECK_CONTAINS(Pack(ArgsFor(bad, x, cap, spill)), "outside [0, N=8)");

  bad = p;
  bad.sorted_slots[0] = -1;
  bad.send_counts = {8, 0};
  bad.send_offsets = {0, 8};
  CHECK_CONTAINS(Pack(ArgsFor(bad, x, cap, spill)), "sorted_slots[0] = -1");

  bad = p;
  bad.send_counts[1] += 1;  // stream runs past N
  CHECK_CONTAINS(Pack(ArgsFor(bad, x, cap, spill)), "stream of destination 1");

  bad = p;
  bad.send_offsets[0] = -1;
  CHECK_CONTAINS(Pack(ArgsFor(bad, x, cap, spill)), "send_offsets[0] = -1");

  bad = p;
  bad.send_counts[0] = -2;
  CHECK_CONTAINS(Pack(ArgsFor(bad, x, cap, spill)), "send_counts[0] = -2");

  PackArgs a = ArgsFor(p, x, cap, spill);
  a.top_k = 0;
  CHECK_CONTAINS(Pack(a), "top_k");
  a = ArgsFor(p, x, cap, spill);
  a.start = -1;
  CHECK_CONTAINS(Pack(a), "start");
  a = ArgsFor(p, x, cap, spill);
  a.capacity = -1;
  CHECK_CONTAINS(Pack(a), "capacity");
  a = ArgsFor(p, x, cap, spill);
  a.spill_capacity = -1;
  CHECK_CONTAINS(Pack(a), "spill_capacity");
  // A malformed slot id outside the windows is never read: no error.
  bad = p;
  bad.sorted_slots[bad.send_offsets[0] + bad.send_counts[0] - 1] = 999;
  a = ArgsFor(bad, x, cap, spill);
  a.capacity = 0;
  a.spill_capacity = 0;
  CHECK_EQ(Pack(a), std::string());
}

}  // namespace

int main() {
  TestEdgeCases();
  TestRandom();
  TestErrors();
  return moe_jax_test::Report("test_pack");
}

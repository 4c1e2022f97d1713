// Test helper: a random dispatch plan as described in
// docs/design/custom_calls.md ("The dispatch plan the calls consume").
#ifndef MOE_JAX_TESTS_CPP_PLAN_H_
#define MOE_JAX_TESTS_CPP_PLAN_H_

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace moe_jax_test {

struct Plan {
  int64_t T = 0, k = 1, P = 1;
  std::vector<int32_t> expert;        // [N] global expert of each slot
  std::vector<int32_t> sorted_slots;  // [N]
  std::vector<int32_t> send_offsets;  // [P]
  std::vector<int32_t> send_counts;   // [P]
  std::vector<int32_t> dest;          // [N]
  std::vector<int32_t> pos;           // [N]
};

// Each slot picks a global expert in [0, P * e_local); `dest_weights[p]`
// biases how likely rank p is (0 makes p receive nothing).
inline Plan MakePlan(int64_t T, int64_t k, int64_t P, int64_t e_local,
                     std::mt19937& rng,
                     std::vector<double> dest_weights = {}) {
  Plan p;
  p.T = T;
  p.k = k;
  p.P = P;
  const int64_t N = T * k;
  if (dest_weights.empty()) dest_weights.assign(P, 1.0);
  std::discrete_distribution<int> pick_rank(dest_weights.begin(),
                                            dest_weights.end());
  std::uniform_int_distribution<int> pick_local(0, int(e_local) - 1);
  p.expert.resize(N);
  for (auto& e : p.expert) e = int32_t(pick_rank(rng) * e_local + pick_local(rng));
  p.sorted_slots.resize(N);
  std::iota(p.sorted_slots.begin(), p.sorted_slots.end(), 0);
  std::stable_sort(p.sorted_slots.begin(), p.sorted_slots.end(),
                   [&](int32_t a, int32_t b) { return p.expert[a] < p.expert[b]; });
  p.send_counts.assign(P, 0);
  p.dest.resize(N);
  for (int64_t n = 0; n < N; ++n) {
    p.dest[n] = int32_t(p.expert[n] / e_local);
    ++p.send_counts[p.dest[n]];
  }
  p.send_offsets.assign(P, 0);
  for (int64_t r = 1; r < P; ++r) {
    p.send_offsets[r] = p.send_offsets[r - 1] + p.send_counts[r - 1];
  }
  p.pos.resize(N);
  for (int64_t r = 0; r < P; ++r) {
    for (int32_t i = 0; i < p.send_counts[r]; ++i) {
      p.pos[p.sorted_slots[p.send_offsets[r] + i]] = i;
    }
  }
  return p;
}

}  // namespace moe_jax_test

#endif  // MOE_JAX_TESTS_CPP_PLAN_H_

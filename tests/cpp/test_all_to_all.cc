// moe_jax_all_to_all core and its rendezvous: P threads meet with ragged
// sizes (zero-size pieces included), loops under one run id, interleaved
// channels, concurrent run ids, and failures that reach every rank (timeout,
// sizes out of range, rank out of range, mismatched rows) without a hang.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/cpp/check.h"
#include "xla_ffi/all_to_all_cpu.h"
#include "xla_ffi/rendezvous.h"

namespace {

using moe_jax::cpu::AllToAll;
using moe_jax::cpu::AllToAllArgs;
using moe_jax::cpu::Rendezvous;
using moe_jax::cpu::RendezvousKey;
using Clock = std::chrono::steady_clock;

constexpr unsigned char kPoison = 0xEE;

// One rank's buffers for one call. Rows are `row_elems` int32 values, each
// encoding (source rank, row index, element, tag) so that every received row
// can be checked.
struct RankData {
  int32_t rank = 0;
  std::vector<int64_t> row_dims{2};
  int64_t row_elems = 2;
  std::vector<int32_t> send;
  int64_t send_rows = 0;
  std::vector<int32_t> send_offsets, send_sizes, recv_offsets;
  std::vector<int32_t> recv;
  int64_t recv_rows = 0;
  std::vector<int32_t> recv_sizes;
  int32_t dtype = 1;
  std::string error;

  AllToAllArgs Args(const RendezvousKey& key, int32_t P) {
    AllToAllArgs a;
    a.key = key;
    a.rank = rank;
    a.num_ranks = P;
    a.send = send.data();
    a.send_rows = send_rows;
    a.row_bytes = row_elems * 4;
    a.dtype = dtype;
    a.dtype_name = "s32";
    a.row_dims = row_dims.data();
    a.row_rank = int64_t(row_dims.size());
    a.send_offsets = send_offsets.data();
    a.send_sizes = send_sizes.data();
    a.recv_offsets = recv_offsets.data();
    a.recv = recv.data();
    a.recv_rows = recv_rows;
    a.recv_sizes = recv_sizes.data();
    return a;
  }
};

int32_t Encode(int32_t src, int64_t row, int64_t e, int32_t tag) {
  return int32_t(tag * 1000000 + src * 10000 + row * 10 + e);
}

// A random ragged exchange: sizes[src][dst] rows, some zero; each rank packs
// its pieces in a shuffled order with gaps, and places incoming pieces in a
// shuffled order with gaps.
std::vector<RankData> MakeExchange(int32_t P, std::mt19937& rng, int32_t tag,
                                   double zero_prob = 0.3) {
  std::vector<std::vector<int32_t>> sizes(P, std::vector<int32_t>(P));
  std::bernoulli_distribution zero(zero_prob);
  for (auto& row : sizes) {
    for (auto& s : row) s = zero(rng) ? 0 : int32_t(1 + rng() % 4);
  }
  std::vector<RankData> ranks(P);
  for (int32_t r = 0; r < P; ++r) {
    RankData& d = ranks[r];
    d.rank = r;
    d.send_offsets.assign(P, 0);
    d.send_sizes.assign(P, 0);
    d.recv_offsets.assign(P, 0);
    d.recv_sizes.assign(P, -7);
    std::vector<int32_t> order(P);
    for (int32_t i = 0; i < P; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    int64_t at = 0;
    for (int32_t dst : order) {
      at += rng() % 2;  // gap
      d.send_offsets[dst] = int32_t(at);
      d.send_sizes[dst] = sizes[r][dst];
      at += sizes[r][dst];
    }
    d.send_rows = at + rng() % 2;
    d.send.assign(d.send_rows * d.row_elems, 0);
    for (int64_t row = 0; row < d.send_rows; ++row) {
      for (int64_t e = 0; e < d.row_elems; ++e) {
        d.send[row * d.row_elems + e] = Encode(r, row, e, tag);
      }
    }
    std::shuffle(order.begin(), order.end(), rng);
    at = 0;
    for (int32_t src : order) {
      at += rng() % 2;
      d.recv_offsets[src] = int32_t(at);
      at += sizes[src][r];
    }
    d.recv_rows = at + rng() % 3;
    d.recv.assign(d.recv_rows * d.row_elems, 0);
    std::memset(d.recv.data(), kPoison, d.recv.size() * 4);
  }
  return ranks;
}

// The spec: recv[recv_offsets[src] + i] = send@src[send_offsets@src[r] + i],
// other rows 0, recv_sizes[src] = send_sizes@src[r].
void Verify(const std::vector<RankData>& ranks) {
  const int32_t P = int32_t(ranks.size());
  for (const RankData& d : ranks) {
    CHECK_EQ(d.error, std::string());
    std::vector<int32_t> expected(d.recv_rows * d.row_elems, 0);
    for (int32_t src = 0; src < P; ++src) {
      const RankData& s = ranks[src];
      const int32_t n = s.send_sizes[d.rank];
      CHECK_EQ(d.recv_sizes[src], n);
      for (int32_t i = 0; i < n; ++i) {
        for (int64_t e = 0; e < d.row_elems; ++e) {
          expected[(d.recv_offsets[src] + i) * d.row_elems + e] =
              s.send[(s.send_offsets[d.rank] + i) * s.row_elems + e];
        }
      }
    }
    CHECK(d.recv == expected);
  }
}

// Runs fn(rank) on P threads at once.
void OnThreads(int32_t P, const std::function<void(int32_t)>& fn) {
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < P; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

void Exchange(Rendezvous& rv, const RendezvousKey& key,
              std::vector<RankData>& ranks, double timeout_s = 30) {
  const int32_t P = int32_t(ranks.size());
  OnThreads(P, [&](int32_t r) {
    ranks[r].error = AllToAll(ranks[r].Args(key, P), timeout_s, rv);
  });
}

void TestRagged() {
  std::mt19937 rng(21);
  Rendezvous rv;
  for (int32_t P : {1, 2, 3, 5, 8}) {
    for (int trial = 0; trial < 5; ++trial) {
      auto ranks = MakeExchange(P, rng, trial);
      Exchange(rv, {100 + P * 10 + trial, 1, 0}, ranks);
      Verify(ranks);
    }
  }
  // Everything empty; one rank sends everything to one rank.
  auto ranks = MakeExchange(4, rng, 0, /*zero_prob=*/1.0);
  Exchange(rv, {200, 1, 0}, ranks);
  Verify(ranks);
  CHECK_EQ(rv.NumMeetings(), size_t(0));  // all meetings were dropped
}

// A call site inside a loop: the same (run id, channel, group) meets once
// per iteration; ranks do not wait for each other between iterations.
void TestLoop() {
  std::mt19937 rng(22);
  Rendezvous rv;
  const int32_t P = 4, kIters = 50;
  std::vector<std::vector<RankData>> iters;
  for (int i = 0; i < kIters; ++i) iters.push_back(MakeExchange(P, rng, i));
  OnThreads(P, [&](int32_t r) {
    for (int i = 0; i < kIters; ++i) {
      if (r == 0 && i % 7 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      iters[i][r].error = AllToAll(iters[i][r].Args({300, 5, 0}, P), 30, rv);
    }
  });
  for (auto& it : iters) Verify(it);
  CHECK_EQ(rv.NumMeetings(), size_t(0));
}

// Two call sites (channel ids), called alternately by every rank, and also
// each from its own thread per rank (so the two channels' meetings overlap).
void TestTwoChannels() {
  std::mt19937 rng(23);
  Rendezvous rv;
  const int32_t P = 3, kIters = 10;
  std::vector<std::vector<RankData>> a, b;
  for (int i = 0; i < kIters; ++i) {
    a.push_back(MakeExchange(P, rng, 2 * i));
    b.push_back(MakeExchange(P, rng, 2 * i + 1));
  }
  OnThreads(P, [&](int32_t r) {
    for (int i = 0; i < kIters; ++i) {
      a[i][r].error = AllToAll(a[i][r].Args({400, 1, 0}, P), 30, rv);
      b[i][r].error = AllToAll(b[i][r].Args({400, 2, 0}, P), 30, rv);
    }
  });
  for (int i = 0; i < kIters; ++i) {
    Verify(a[i]);
    Verify(b[i]);
  }
  std::vector<std::vector<RankData>> c, d;
  for (int i = 0; i < kIters; ++i) {
    c.push_back(MakeExchange(P, rng, 3 * i));
    d.push_back(MakeExchange(P, rng, 3 * i + 1));
  }
  OnThreads(2 * P, [&](int32_t t) {
    const int32_t r = t % P;
    auto& data = t < P ? c : d;
    const int64_t chan = t < P ? 7 : 8;
    for (int i = 0; i < kIters; ++i) {
      data[i][r].error = AllToAll(data[i][r].Args({401, chan, 0}, P), 30, rv);
    }
  });
  for (int i = 0; i < kIters; ++i) {
    Verify(c[i]);
    Verify(d[i]);
  }
  CHECK_EQ(rv.NumMeetings(), size_t(0));
}

// Concurrent executions (different run ids) and different group keys with
// the same channel never mix.
void TestConcurrentRuns() {
  std::mt19937 rng(24);
  Rendezvous rv;
  const int32_t P = 4, kRuns = 4, kIters = 8;
  std::vector<std::vector<std::vector<RankData>>> data(kRuns);
  for (auto& run : data) {
    for (int i = 0; i < kIters; ++i) run.push_back(MakeExchange(P, rng, i));
  }
  OnThreads(P * kRuns, [&](int32_t t) {
    const int32_t run = t / P, r = t % P;
    // Runs 0, 1: different run ids; runs 2, 3: same run id, other group keys.
    const RendezvousKey key = run < 2 ? RendezvousKey{500 + run, 1, 0}
                                      : RendezvousKey{502, 1, run};
    for (int i = 0; i < kIters; ++i) {
      data[run][i][r].error = AllToAll(data[run][i][r].Args(key, P), 30, rv);
    }
  });
  for (auto& run : data) {
    for (auto& it : run) Verify(it);
  }
  CHECK_EQ(rv.NumMeetings(), size_t(0));
}

// Runs the exchange and checks that every rank failed with `needle` in its
// error, quickly (no rank waited for the 30 s timeout).
void ExpectAllFail(std::vector<RankData>& ranks, const RendezvousKey& key,
                   const std::string& needle, Rendezvous& rv) {
  const auto t0 = Clock::now();
  Exchange(rv, key, ranks, /*timeout_s=*/30);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  CHECK(secs < 10);
  for (const RankData& d : ranks) CHECK_CONTAINS(d.error, needle);
}

void TestErrorsReachEveryRank() {
  std::mt19937 rng(25);
  Rendezvous rv;
  const int32_t P = 4;
  auto fresh = [&] { return MakeExchange(P, rng, 0, 0.0); };

  auto ranks = fresh();
  ranks[2].send_sizes[1] = int32_t(ranks[2].send_rows + 1);  // past the end
  ExpectAllFail(ranks, {600, 1, 0}, "rank 2: send_offsets[1]", rv);

  ranks = fresh();
  ranks[1].send_sizes[3] = -1;
  ExpectAllFail(ranks, {601, 1, 0}, "send_sizes[3] = -1", rv);

  ranks = fresh();
  ranks[3].send_offsets[0] = -5;
  ExpectAllFail(ranks, {602, 1, 0}, "send_offsets[0] = -5", rv);

  ranks = fresh();
  ranks[0].recv_offsets[2] = int32_t(ranks[0].recv_rows + 1);
  ExpectAllFail(ranks, {603, 1, 0}, "rank 0: recv_offsets[2]", rv);

  // Incoming rows that do not fit: only the receiver's plan shows it, yet
  // every rank fails.
  ranks = fresh();
  ranks[0].recv_offsets[1] = int32_t(ranks[0].recv_rows - ranks[1].send_sizes[0] + 1);
  ExpectAllFail(ranks, {604, 1, 0}, "rank 0 would receive", rv);

  ranks = fresh();
  ranks[2].dtype = 9;  // other dtype
  ExpectAllFail(ranks, {605, 1, 0}, "ranks disagree on the row type", rv);

  ranks = fresh();
  ranks[1].row_dims = {1, 2};  // same bytes, other row shape
  ExpectAllFail(ranks, {606, 1, 0}, "ranks disagree on the row type", rv);

  // A rank index outside [0, P): the others fail instead of waiting for
  // rank 3.
  ranks = fresh();
  ranks[3].rank = 7;
  ExpectAllFail(ranks, {607, 1, 0}, "rank 7 is outside [0, 4)", rv);

  // Ranks disagreeing on the group size.
  ranks = fresh();
  {
    const auto t0 = Clock::now();
    OnThreads(P, [&](int32_t r) {
      if (r == 0) {  // rank 0 believes in 5 ranks (its arrays have 5 entries)
        ranks[0].send_offsets.push_back(0);
        ranks[0].send_sizes.push_back(0);
        ranks[0].recv_offsets.push_back(0);
        ranks[0].recv_sizes.push_back(0);
      }
      AllToAllArgs a = ranks[r].Args({608, 1, 0}, r == 0 ? 5 : P);
      ranks[r].error = AllToAll(a, 30, rv);
    });
    CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 10);
    for (const RankData& d : ranks) CHECK_CONTAINS(d.error, "group size");
  }

  // After failed meetings, the same run id still works for later calls of
  // other channels.
  ranks = fresh();
  Exchange(rv, {608, 2, 0}, ranks);
  Verify(ranks);
}

void TestTimeout() {
  std::mt19937 rng(26);
  Rendezvous rv;
  const int32_t P = 4;
  auto ranks = MakeExchange(P, rng, 0);
  const auto t0 = Clock::now();
  // Ranks 0, 1, 3 arrive; rank 2 does not (yet).
  OnThreads(P, [&](int32_t r) {
    if (r == 2) return;
    ranks[r].error = AllToAll(ranks[r].Args({700, 3, 0}, P), 0.3, rv);
  });
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  CHECK(secs >= 0.25);
  CHECK(secs < 10);
  for (int32_t r : {0, 1, 3}) {
    CHECK_CONTAINS(ranks[r].error, "timed out after 0.3 s");
    CHECK_CONTAINS(ranks[r].error, "arrived ranks [0, 1, 3], missing ranks [2]");
    CHECK_CONTAINS(ranks[r].error, "channel_id=3");
  }
  // The late rank fails at once instead of waiting for its own timeout.
  const auto t1 = Clock::now();
  ranks[2].error = AllToAll(ranks[2].Args({700, 3, 0}, P), 30, rv);
  CHECK(std::chrono::duration<double>(Clock::now() - t1).count() < 5);
  CHECK_CONTAINS(ranks[2].error, "timed out");
  CHECK_EQ(rv.NumMeetings(), size_t(0));  // all four ranks left it

  // With a single rank arriving, it names itself.
  std::string err = AllToAll(ranks[1].Args({701, 3, 0}, P), 0.05, rv);
  CHECK_CONTAINS(err, "arrived ranks [1], missing ranks [0, 2, 3]");
}

// Overlapping receive windows (outside the spec): the lowest source wins,
// as in the pure-JAX reference.
void TestOverlappingWindows() {
  std::mt19937 rng(29);
  Rendezvous rv;
  auto ranks = MakeExchange(3, rng, 0, /*zero_prob=*/0.0);
  RankData& d = ranks[1];
  for (int32_t src = 0; src < 3; ++src) d.recv_offsets[src] = 0;
  d.recv_rows = 4;
  d.recv.assign(d.recv_rows * d.row_elems, 0);
  Exchange(rv, {1100, 1, 0}, ranks);
  CHECK_EQ(d.error, std::string());
  std::vector<int32_t> expected(d.recv_rows * d.row_elems, 0);
  for (int32_t src = 2; src >= 0; --src) {
    const RankData& s = ranks[src];
    const int64_t n = s.send_sizes[1] * d.row_elems;
    std::copy(s.send.begin() + s.send_offsets[1] * s.row_elems,
              s.send.begin() + s.send_offsets[1] * s.row_elems + n, expected.begin());
  }
  CHECK(d.recv == expected);
}

// Sequence counters are kept only for recent run ids; meetings are dropped
// once all ranks left.
void TestBoundedState() {
  std::mt19937 rng(27);
  Rendezvous rv(/*max_runs=*/4);
  for (int run = 0; run < 20; ++run) {
    auto ranks = MakeExchange(3, rng, run);
    Exchange(rv, {800 + run, 1, 0}, ranks);
    Verify(ranks);
    CHECK(rv.NumTrackedRuns() <= 4);
    CHECK_EQ(rv.NumMeetings(), size_t(0));
  }
  // A failed meeting with a rank that never came stays until its run is
  // evicted.
  auto ranks = MakeExchange(3, rng, 0);
  CHECK(!AllToAll(ranks[0].Args({900, 1, 0}, 3), 0.01, rv).empty());
  CHECK_EQ(rv.NumMeetings(), size_t(1));  // ranks 1 and 2 may still come
  for (int run = 0; run < 6; ++run) {
    auto more = MakeExchange(3, rng, run);
    Exchange(rv, {901 + run, 1, 0}, more);
    Verify(more);
  }
  CHECK(rv.NumTrackedRuns() <= 4);
  CHECK_EQ(rv.NumMeetings(), size_t(0));
}

// Two groups that share one group key (and run id) but run on different
// devices are detected instead of being mixed silently; nobody hangs.
void TestGroupCollision() {
  std::mt19937 rng(28);
  Rendezvous rv;
  const int32_t P = 2;
  auto g0 = MakeExchange(P, rng, 0), g1 = MakeExchange(P, rng, 1);
  std::atomic<int> failures{0};
  const auto t0 = Clock::now();
  OnThreads(2 * P, [&](int32_t t) {
    auto& data = t < P ? g0 : g1;
    const int32_t r = t % P;
    AllToAllArgs a = data[r].Args({1000, 1, 0}, P);
    a.device = t;  // four distinct devices
    data[r].error = AllToAll(a, 5, rv);
    if (!data[r].error.empty()) ++failures;
  });
  CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 4);
  CHECK(failures.load() >= 2);
  bool named = false;
  for (auto* g : {&g0, &g1}) {
    for (auto& d : *g) {
      named = named || d.error.find("share one group_key") != std::string::npos;
    }
  }
  CHECK(named);
}

void TestTimeoutFromEnv() {
  unsetenv("MOE_JAX_CPU_A2A_TIMEOUT_S");
  CHECK_EQ(moe_jax::cpu::AllToAllTimeoutFromEnv(), 300.0);
  setenv("MOE_JAX_CPU_A2A_TIMEOUT_S", "2.5", 1);
  CHECK_EQ(moe_jax::cpu::AllToAllTimeoutFromEnv(), 2.5);
  setenv("MOE_JAX_CPU_A2A_TIMEOUT_S", "junk", 1);
  CHECK_EQ(moe_jax::cpu::AllToAllTimeoutFromEnv(), 300.0);
  setenv("MOE_JAX_CPU_A2A_TIMEOUT_S", "-1", 1);
  CHECK_EQ(moe_jax::cpu::AllToAllTimeoutFromEnv(), 300.0);
  unsetenv("MOE_JAX_CPU_A2A_TIMEOUT_S");
}

}  // namespace

int main() {
  TestRagged();
  TestLoop();
  TestTwoChannels();
  TestConcurrentRuns();
  TestErrorsReachEveryRank();
  TestTimeout();
  TestOverlappingWindows();
  TestBoundedState();
  TestGroupCollision();
  TestTimeoutFromEnv();
  return moe_jax_test::Report("test_all_to_all");
}

// An in-process meeting point for the ranks of a CPU collective. Each device
// of a multi-device XLA:CPU execution runs on its own thread; the ranks of one
// call meet here, publish a pointer to what they contribute, and read each
// other's contributions. Plain C++ (std::mutex + std::condition_variable).
//
// A meeting is identified by (run id, channel id, group key, sequence number),
// where the sequence number counts how many times this rank already joined
// under the same (run id, channel id, group key): a call site inside a loop
// meets once per iteration. Memory stays bounded: a meeting is dropped once
// all its ranks left it, and sequence counters are kept only for the most
// recently used run ids.
#ifndef MOE_JAX_XLA_FFI_RENDEZVOUS_H_
#define MOE_JAX_XLA_FFI_RENDEZVOUS_H_

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace moe_jax::cpu {

struct RendezvousKey {
  int64_t run_id = 0;
  int64_t channel_id = 0;
  int64_t group_key = 0;
};

class Rendezvous {
 public:
  // Sequence counters are kept for the `max_runs` most recently used run ids.
  explicit Rendezvous(size_t max_runs = 512);
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;
  ~Rendezvous();

  struct Meeting;

  // One rank's membership in one meeting. Leaves the meeting on destruction.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    ~Ticket();
    int64_t sequence() const { return sequence_; }

   private:
    friend class Rendezvous;
    Rendezvous* owner_ = nullptr;
    std::shared_ptr<Meeting> meeting_;
    int32_t rank_ = -1;
    int64_t sequence_ = -1;
    bool finished_ = false;
  };

  struct Arrival {
    RendezvousKey key;
    int32_t rank = 0;
    int32_t num_ranks = 1;
    int64_t device = -1;  // id of the calling device; -1 if unknown
    const void* payload = nullptr;
    // Non-empty: this rank cannot take part; the meeting fails on every rank
    // with this text (prefixed by the rank that reported it).
    std::string local_error;
  };

  // Publishes `payload` as `rank` in this rank's next meeting under `key` and
  // blocks until all `num_ranks` ranks have published. Returns "" and fills
  // `payloads` (indexed by rank) on success. Otherwise returns why the
  // meeting failed; every rank of a failed meeting fails, none waits for the
  // timeout once the failure is known: a local error, a rank out of range,
  // a rank arriving twice, ranks disagreeing on num_ranks, a rank run by two
  // different devices in one run (two groups sharing one group key), or
  // ranks missing at the timeout (the text lists the ranks that arrived).
  std::string Join(const Arrival& arrival, double timeout_s, Ticket* ticket,
                   std::vector<const void*>* payloads);

  // Second barrier: returns "" once every rank of the meeting called Finish.
  // After a successful Join each rank must call Finish before it returns, so
  // no rank frees what it published while a peer still reads it.
  std::string Finish(Ticket* ticket, double timeout_s);

  // For tests: meetings currently held, run ids currently tracked.
  size_t NumMeetings() const;
  size_t NumTrackedRuns() const;

 private:
  using MeetingKey = std::tuple<int64_t, int64_t, int64_t, int64_t>;
  using CounterKey = std::tuple<int64_t, int64_t, int64_t>;  // chan, group, rank
  struct Counter {
    int64_t next_sequence = 0;
    int64_t device = -1;
  };
  struct RunState {
    std::map<CounterKey, Counter> counters;
    std::list<int64_t>::iterator lru_pos;
  };

  RunState& TouchRun(int64_t run_id);  // requires mu_
  void EvictRun(int64_t run_id);       // requires mu_
  void Leave(Ticket* ticket);

  const size_t max_runs_;
  mutable std::mutex mu_;
  std::map<MeetingKey, std::shared_ptr<Meeting>> meetings_;
  std::unordered_map<int64_t, RunState> runs_;
  std::list<int64_t> lru_;  // most recently used run id first
};

// The process-wide rendezvous used by the moe_jax_all_to_all CPU handler.
Rendezvous& GlobalAllToAllRendezvous();

}  // namespace moe_jax::cpu

#endif  // MOE_JAX_XLA_FFI_RENDEZVOUS_H_

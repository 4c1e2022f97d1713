#include "xla_ffi/rendezvous.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <limits>
#include <sstream>
#include <utility>

namespace moe_jax::cpu {

struct Rendezvous::Meeting {
  MeetingKey key;
  int32_t num_ranks = 0;
  std::vector<const void*> payloads;
  std::vector<uint8_t> arrived;   // member ranks (published or failed)
  std::vector<uint8_t> finished;  // ranks that called Finish
  int32_t num_arrived = 0;
  int32_t num_finished = 0;
  int32_t num_left = 0;
  bool complete = false;  // all ranks published before any failure
  std::string error;      // set only while !complete: the meeting failed
  std::condition_variable cv;
};

namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point Deadline(double timeout_s) {
  // Clamp so that huge values from the environment cannot overflow.
  const double s = std::min(std::max(timeout_s, 0.0), 1e8);
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(s));
}

std::string Describe(int64_t run_id, int64_t channel_id, int64_t group_key,
                     int64_t sequence) {
  std::ostringstream os;
  os << "channel_id=" << channel_id << " group_key=" << group_key << " call #"
     << sequence << " of run_id=" << run_id;
  return os.str();
}

std::string RankList(const std::vector<uint8_t>& flags, bool value) {
  std::ostringstream os;
  os << "[";
  bool first = true;
  for (size_t r = 0; r < flags.size(); ++r) {
    if ((flags[r] != 0) != value) continue;
    os << (first ? "" : ", ") << r;
    first = false;
  }
  os << "]";
  return os.str();
}

std::string FormatTimeout(double timeout_s) {
  std::ostringstream os;
  os << timeout_s;
  return os.str();
}

}  // namespace

Rendezvous::Rendezvous(size_t max_runs) : max_runs_(std::max<size_t>(1, max_runs)) {}

Rendezvous::~Rendezvous() = default;

Rendezvous::Ticket::~Ticket() {
  if (owner_ != nullptr) owner_->Leave(this);
}

Rendezvous::RunState& Rendezvous::TouchRun(int64_t run_id) {
  auto it = runs_.find(run_id);
  if (it != runs_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second.lru_pos);
    return it->second;
  }
  while (runs_.size() >= max_runs_) EvictRun(lru_.back());
  lru_.push_front(run_id);
  RunState& state = runs_[run_id];
  state.lru_pos = lru_.begin();
  return state;
}

void Rendezvous::EvictRun(int64_t run_id) {
  auto it = runs_.find(run_id);
  if (it != runs_.end()) {
    lru_.erase(it->second.lru_pos);
    runs_.erase(it);
  }
  // Fail and forget the meetings still held for this run (their members keep
  // the Meeting alive through their tickets).
  const int64_t lo = std::numeric_limits<int64_t>::min();
  auto first = meetings_.lower_bound(MeetingKey{run_id, lo, lo, lo});
  auto last = first;
  while (last != meetings_.end() && std::get<0>(last->first) == run_id) {
    Meeting& m = *last->second;
    if (!m.complete && m.error.empty()) {
      m.error = "rendezvous state of run_id=" + std::to_string(run_id) +
                " was evicted: more than " + std::to_string(max_runs_) +
                " other runs used the rendezvous since";
      m.cv.notify_all();
    }
    ++last;
  }
  meetings_.erase(first, last);
}

std::string Rendezvous::Join(const Arrival& a, double timeout_s,
                             Ticket* ticket, std::vector<const void*>* payloads) {
  const auto deadline = Deadline(timeout_s);
  const RendezvousKey& k = a.key;
  if (a.num_ranks < 1) {
    return "the group size must be >= 1, got " + std::to_string(a.num_ranks);
  }
  std::unique_lock<std::mutex> lock(mu_);
  RunState& run = TouchRun(k.run_id);
  Counter& counter = run.counters[CounterKey{k.channel_id, k.group_key, a.rank}];
  const int64_t seq = counter.next_sequence++;
  std::string local_error = a.local_error;
  if (local_error.empty() && a.device >= 0) {
    if (counter.device < 0) {
      counter.device = a.device;
    } else if (counter.device != a.device) {
      local_error = "rank " + std::to_string(a.rank) + " was run by device " +
                    std::to_string(counter.device) + " and by device " +
                    std::to_string(a.device) +
                    " in one execution: two groups share one group_key; give "
                    "each group its own group_key";
    }
  }
  const std::string where = Describe(k.run_id, k.channel_id, k.group_key, seq);

  const MeetingKey mkey{k.run_id, k.channel_id, k.group_key, seq};
  std::shared_ptr<Meeting>& slot = meetings_[mkey];
  if (!slot) {
    slot = std::make_shared<Meeting>();
    slot->key = mkey;
    slot->num_ranks = a.num_ranks;
    slot->payloads.assign(a.num_ranks, nullptr);
    slot->arrived.assign(a.num_ranks, 0);
    slot->finished.assign(a.num_ranks, 0);
  }
  std::shared_ptr<Meeting> m = slot;

  // Arrivals that cannot become members fail the meeting and leave at once.
  std::string outsider;
  if (a.rank < 0 || a.rank >= m->num_ranks) {
    outsider = "rank " + std::to_string(a.rank) + " is outside [0, " +
               std::to_string(m->num_ranks) + ")";
  } else if (a.num_ranks != m->num_ranks) {
    outsider = "rank " + std::to_string(a.rank) + " has group size " +
               std::to_string(a.num_ranks) + " but the group has size " +
               std::to_string(m->num_ranks);
  } else if (m->arrived[a.rank]) {
    outsider = "rank " + std::to_string(a.rank) + " arrived twice";
  }
  if (!outsider.empty()) {
    outsider += " (" + where + ")";
    if (!m->complete && m->error.empty()) {
      m->error = outsider;
      m->cv.notify_all();
    }
    return outsider;
  }

  ticket->owner_ = this;
  ticket->meeting_ = m;
  ticket->rank_ = a.rank;
  ticket->sequence_ = seq;
  m->arrived[a.rank] = 1;
  ++m->num_arrived;
  if (!local_error.empty() && m->error.empty()) {
    m->error = "rank " + std::to_string(a.rank) + ": " + local_error + " (" +
               where + ")";
    m->cv.notify_all();
  }
  if (!m->error.empty()) return m->error;
  m->payloads[a.rank] = a.payload;
  if (m->num_arrived == m->num_ranks) {
    m->complete = true;
    m->cv.notify_all();
  }
  const bool done = m->cv.wait_until(lock, deadline, [&] {
    return m->complete || !m->error.empty();
  });
  if (m->complete) {
    *payloads = m->payloads;
    return {};
  }
  if (!done && m->error.empty()) {
    m->error = "timed out after " + FormatTimeout(timeout_s) +
               " s waiting for all " + std::to_string(m->num_ranks) +
               " ranks to arrive (" + where + "): arrived ranks " +
               RankList(m->arrived, true) + ", missing ranks " +
               RankList(m->arrived, false);
    m->cv.notify_all();
  }
  return m->error;
}

std::string Rendezvous::Finish(Ticket* ticket, double timeout_s) {
  const auto deadline = Deadline(timeout_s);
  std::unique_lock<std::mutex> lock(mu_);
  Meeting& m = *ticket->meeting_;
  if (!ticket->finished_) {
    ticket->finished_ = true;
    m.finished[ticket->rank_] = 1;
    if (++m.num_finished == m.num_ranks) m.cv.notify_all();
  }
  if (m.cv.wait_until(lock, deadline,
                      [&] { return m.num_finished == m.num_ranks; })) {
    return {};
  }
  return "timed out after " + FormatTimeout(timeout_s) +
         " s waiting for ranks " + RankList(m.finished, false) +
         " to finish copying (" +
         Describe(std::get<0>(m.key), std::get<1>(m.key), std::get<2>(m.key),
                  std::get<3>(m.key)) +
         ")";
}

void Rendezvous::Leave(Ticket* ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  Meeting& m = *ticket->meeting_;
  if (++m.num_left == m.num_ranks) {
    auto it = meetings_.find(m.key);
    if (it != meetings_.end() && it->second == ticket->meeting_) {
      meetings_.erase(it);
    }
  }
  ticket->owner_ = nullptr;
}

size_t Rendezvous::NumMeetings() const {
  std::lock_guard<std::mutex> lock(mu_);
  return meetings_.size();
}

size_t Rendezvous::NumTrackedRuns() const {
  std::lock_guard<std::mutex> lock(mu_);
  return runs_.size();
}

Rendezvous& GlobalAllToAllRendezvous() {
  static Rendezvous* rendezvous = new Rendezvous();  // never destroyed
  return *rendezvous;
}

}  // namespace moe_jax::cpu

#include "xla_ffi/fast/plan.h"

#include <algorithm>
#include <cstdint>

namespace moe_jax::fast {
namespace {

// Indexes the row range of every stage; "" or an internal error.
std::string IndexStages(const FastSchedule& schedule, StageIndex* index) {
  const int64_t* tr = schedule.transfers.data();
  const int64_t* rd = schedule.redistribution.data();
  const int64_t nt =
      static_cast<int64_t>(schedule.transfers.size()) / kTransferCols;
  const int64_t nr =
      static_cast<int64_t>(schedule.redistribution.size()) / kTransferCols;
  const size_t codes = 2 * static_cast<size_t>(schedule.num_stages) + 3;
  index->begin.assign(codes, 0);
  index->end.assign(codes, 0);
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t st = tr[i * kTransferCols + kStage];
    if (st < 0 || st >= static_cast<int64_t>(codes) || (st >= 2 && st % 2)) {
      return "internal error: schedule row with stage " + std::to_string(st);
    }
    if (index->end[st] == 0) index->begin[st] = i;
    index->end[st] = i + 1;
  }
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t st = rd[i * kTransferCols + kStage];
    if (st < 3 || st >= static_cast<int64_t>(codes) || st % 2 == 0) {
      return "internal error: redistribution row with stage " +
             std::to_string(st);
    }
    if (index->end[st] == 0) index->begin[st] = i;
    index->end[st] = i + 1;
  }
  return {};
}

// Splits the intra-server part over the BvN stages (plan.py's
// intra_cuts): the first min(S, 2n) stages in run order carry each flow in
// proportion to their size (largest real unit count over servers), the
// rest none.  At(k) moves to stage k, whose share of a flow of `amount`
// rows is rows [Lo(amount), Hi(amount)); stages go in order.
class IntraCuts {
 public:
  explicit IntraCuts(const FastSchedule& schedule)
      : schedule_(schedule),
        carriers_(std::min(schedule.num_stages, 2 * schedule.num_servers)) {
    for (int k = 0; k < carriers_; ++k) total_ += Size(k);
  }
  void At(int k) {
    lo_ = hi_;
    if (k < carriers_) hi_ += Size(k);
    first_ = k == 0;
  }
  // Whether stage k (after At(k)) carries any of the intra-server part.
  bool Carries(int k) const {
    return total_ == 0 ? k == 0 : k < carriers_;
  }
  int64_t Lo(int64_t amount) const { return Cut(amount, lo_, !first_); }
  int64_t Hi(int64_t amount) const { return Cut(amount, hi_, true); }

 private:
  int64_t Size(int k) const {
    const int n = schedule_.num_servers;
    const int64_t* r = schedule_.real.data() + static_cast<size_t>(k) * n;
    return *std::max_element(r, r + n);
  }
  // Rows before cumulative size `cum`; without sizes all go in stage 0.
  int64_t Cut(int64_t amount, int64_t cum, bool after_first) const {
    if (total_ == 0) return after_first ? amount : 0;
    int64_t product;
    if (!__builtin_mul_overflow(amount, cum, &product)) {
      return product / total_;
    }
    return static_cast<int64_t>(static_cast<__int128>(amount) * cum /
                                total_);
  }

  const FastSchedule& schedule_;
  int carriers_;
  int64_t total_ = 0;
  int64_t lo_ = 0, hi_ = 0;
  bool first_ = true;
};

// Of a redistribution row of `amount` units of BvN stage k < S - 1, the
// last RedistributionTail(amount) run a phase later (plan.py's
// redistribution_split): a quarter, rounded down.
constexpr int64_t kDeferNum = 1, kDeferDen = 4;
int64_t RedistributionTail(int64_t amount) {
  return static_cast<int64_t>(static_cast<__int128>(amount) * kDeferNum /
                              kDeferDen);
}

// Calls, until one returns false, in plan order: balance(k, phase) for
// the balancing by use of BvN stage k (k = 0 in phase 0, k = 1 in phase
// 1; k > 1 in two parts, the early one in phase k - 1 after the rest of
// stage k - 1's, the rest in phase k), and apply(row, phase, first, rows)
// on every other row
// (`rows` of its units from unit `first` on): without BvN stages the
// intra-server part (phase 0); else per stage k the scale-out of stage k
// (phase k + 1), stage k's share of the intra-server part (IntraCuts), the
// tail of stage k - 2's redistribution rows (k > 1), the head of stage
// k - 1's (k > 0; head and tail: RedistributionTail), then the balancing
// of stage k + 1 and the early part of stage k + 2's; in phase S + 1 the tail of stage S - 2's and the whole
// last redistribution.  Balancing rows (stage 0) are not applied: the
// balancing moves by use.  Returns whether every call returned true.
template <typename Apply, typename Balance>
bool RunStages(const FastSchedule& schedule, const StageIndex& index,
               Apply apply, Balance balance) {
  const int64_t* tr = schedule.transfers.data();
  const int64_t* rd = schedule.redistribution.data();
  auto run = [&](int64_t st, int64_t phase) {
    const int64_t* rows = st >= 3 && st % 2 ? rd : tr;
    for (int64_t i = index.begin[st]; i < index.end[st]; ++i) {
      const int64_t* row = rows + i * kTransferCols;
      if (!apply(row, phase, 0, row[kAmount])) return false;
    }
    return true;
  };
  // Head (tail = false) or tail of every redistribution row of code st.
  auto run_part = [&](int64_t st, int64_t phase, bool tail) {
    for (int64_t i = index.begin[st]; i < index.end[st]; ++i) {
      const int64_t* row = rd + i * kTransferCols;
      const int64_t late = RedistributionTail(row[kAmount]);
      const int64_t first = tail ? row[kAmount] - late : 0;
      const int64_t rows = tail ? late : row[kAmount] - late;
      if (rows > 0 && !apply(row, phase, first, rows)) return false;
    }
    return true;
  };
  const int s = schedule.num_stages;
  if (s == 0) return run(1, 0);
  if (!balance(0, 0)) return false;
  IntraCuts cuts(schedule);
  for (int k = 0; k < s; ++k) {
    const int64_t phase = k + 1;
    if (!run(2 + 2 * static_cast<int64_t>(k), phase)) return false;
    cuts.At(k);
    for (int64_t i = index.begin[1]; cuts.Carries(k) && i < index.end[1];
         ++i) {
      const int64_t* row = tr + i * kTransferCols;
      const int64_t lo = cuts.Lo(row[kAmount]), hi = cuts.Hi(row[kAmount]);
      if (hi > lo && !apply(row, phase, lo, hi - lo)) return false;
    }
    if (k > 1 && !run_part(2 * static_cast<int64_t>(k) - 1, phase, true)) {
      return false;
    }
    if (k > 0 && !run_part(1 + 2 * static_cast<int64_t>(k), phase, false)) {
      return false;
    }
    if (k + 1 < s && !balance(k + 1, phase)) return false;
    if (k + 2 < s && !balance(k + 2, phase)) return false;
  }
  if (s > 1 && !run_part(2 * static_cast<int64_t>(s) - 1, s + 1, true)) {
    return false;
  }
  return run(1 + 2 * static_cast<int64_t>(s), s + 1);
}

std::string FlowText(int64_t fs, int64_t fd) {
  return "(" + std::to_string(fs) + ", " + std::to_string(fd) + ")";
}

}  // namespace

int ProgramPhases(int num_stages, int gpus_per_server, bool any_traffic) {
  if (num_stages > 0) return num_stages + (gpus_per_server > 1 ? 2 : 1);
  return any_traffic ? 1 : 0;
}

// NIC : NVLink bandwidth per GPU the balancing split is sized for.
constexpr int64_t kNic = 1, kNvlink = 9;

void BalancingEarly::Size(const FastSchedule& schedule) {
  const int n = schedule.num_servers, s = schedule.num_stages;
  const int64_t m = schedule.gpus_per_server;
  room_.assign(static_cast<size_t>(s) + 1, 0);
  need_.assign(s, 0);
  early_.assign(s, 0);
  for (int k = 0; k < s; ++k) {
    const int64_t* r = schedule.real.data() + static_cast<size_t>(k) * n;
    const int64_t size = *std::max_element(r, r + n);
    room_[k + 1] = kNvlink * size;
    need_[k] = kNic * (m - 1) * size;
  }
  for (int k = s - 1; k > 0; --k) {
    const int64_t own = std::min(room_[k], need_[k]);
    room_[k] -= own;
    if (k >= 2) {
      early_[k] = std::min(room_[k - 1], need_[k] - own);
      room_[k - 1] -= early_[k];
    }
  }
}

int64_t BalancingEarly::Rows(int64_t amount, int k) const {
  if (k < 2 || early_[k] == 0) return 0;
  return static_cast<int64_t>(static_cast<__int128>(amount) * early_[k] /
                              need_[k]);
}

void ExecutionPlanner::Add(uint64_t key, const Segment& s) {
  std::vector<Segment>& segs = hold_[key];
  auto it = std::lower_bound(
      segs.begin(), segs.end(), s.flow_row,
      [](const Segment& a, int64_t row) { return a.flow_row < row; });
  segs.insert(it, s);
}

std::string ExecutionPlanner::Take(uint64_t key, int64_t amount,
                                   bool from_tail, int64_t phase, int64_t gpu,
                                   int64_t fs, int64_t fd) {
  pieces_.clear();
  auto found = hold_.find(key);
  const auto flow = [&] {
    return "(" + std::to_string(fs) + ", " + std::to_string(fd) + ")";
  };
  while (amount > 0) {
    if (found == hold_.end() || found->second.empty()) {
      return "GPU " + std::to_string(gpu) + " does not hold " +
             std::to_string(amount) + " more rows of flow " + flow();
    }
    std::vector<Segment>& segs = found->second;
    Segment& seg = from_tail ? segs.back() : segs.front();
    if (seg.ready > phase) {
      return "phase " + std::to_string(phase) + ": GPU " + std::to_string(gpu) +
             " would forward rows of flow " + flow() + " that arrive in phase " +
             std::to_string(seg.ready - 1);
    }
    const int64_t y = std::min(amount, seg.rows);
    if (from_tail) {
      pieces_.push_back({seg.flow_row + seg.rows - y, y, seg.buf,
                         seg.row + seg.rows - y});
    } else {
      pieces_.push_back({seg.flow_row, y, seg.buf, seg.row});
      seg.flow_row += y;
      seg.row += y;
    }
    seg.rows -= y;
    amount -= y;
    if (seg.rows == 0) {
      if (from_tail) {
        segs.pop_back();
      } else {
        segs.erase(segs.begin());
      }
    }
  }
  if (found != hold_.end() && found->second.empty()) hold_.erase(found);
  if (from_tail) std::reverse(pieces_.begin(), pieces_.end());
  return {};
}

// One schedule row (kTransferCols columns) in `phase`.
std::string ExecutionPlanner::Apply(const int64_t* row, int64_t phase,
                                    int64_t rows, ExecutionPlan* out) {
  const int64_t src = row[kSrc], dst = row[kDst];
  const int64_t fs = row[kFlowSrc], fd = row[kFlowDst];
  if (std::string err = Take(Key(src, fs, fd), rows,
                             row[kStage] == 0, phase, src, fs, fd);
      !err.empty()) {
    return err;
  }
  for (const Piece& p : pieces_) {
    int64_t dst_buf = kBufOut;
    int64_t dst_row = recv_off_[fs * g_ + fd] + p.flow_row;
    if (dst != fd) {
      dst_buf = kBufWs;
      dst_row = out->workspace_used[dst];
      out->workspace_used[dst] += p.rows;
      Add(Key(dst, fs, fd), {p.flow_row, p.rows, kBufWs, dst_row, phase + 1});
    }
    out->ops.insert(out->ops.end(), {phase, src, dst, p.rows, p.buf, p.row,
                                     dst_buf, dst_row, fs, fd, p.flow_row});
  }
  return {};
}

// Balancing by use of BvN stage k: for every scale-out row of stage k whose
// sender is not the flow's source, the rows it sends move from the source
// to it, from the front of their reserved range, into workspace reserved
// for the whole row.  Stage k > 1 runs in two parts: in phase k - 1 the
// first early_.Rows(amount, k) rows of each (the rest kept in late_ops_),
// in phase k the rest.
std::string ExecutionPlanner::Balance(const FastSchedule& schedule, int k,
                                      int64_t phase, ExecutionPlan* out) {
  if (k >= 2 && phase == k) {
    out->ops.insert(out->ops.end(), late_ops_.begin(), late_ops_.end());
    late_ops_.clear();
    return {};
  }
  const int64_t st = 2 + 2 * static_cast<int64_t>(k);
  for (int64_t i = stages_.begin[st]; i < stages_.end[st]; ++i) {
    const int64_t* row = schedule.transfers.data() + i * kTransferCols;
    const int64_t j = row[kSrc], fs = row[kFlowSrc], fd = row[kFlowDst];
    if (j == fs) continue;
    std::vector<Range>& ranges = reserved_[Key(j, fs, fd)];
    const int64_t amount = row[kAmount];
    const int64_t head = phase < k ? early_.Rows(amount, k) : amount;
    int64_t left = amount;
    while (left > 0) {
      if (ranges.empty()) {
        return "internal error: GPU " + std::to_string(j) + " sends rows of "
               "flow " + FlowText(fs, fd) + " it was not given";
      }
      Range& r = ranges.back();
      const int64_t y = std::min(left, r.rows);
      const int64_t dst_row = out->workspace_used[j];
      out->workspace_used[j] += y;
      Add(Key(j, fs, fd), {r.first, y, kBufWs, dst_row, k + 1});
      const int64_t now =
          std::clamp<int64_t>(head - (amount - left), 0, y);
      const int64_t src_row = send_off_[fs * g_ + fd] + r.first;
      if (now > 0) {
        out->ops.insert(out->ops.end(), {phase, fs, j, now, kBufX, src_row,
                                         kBufWs, dst_row, fs, fd, r.first});
      }
      if (y > now) {
        late_ops_.insert(late_ops_.end(),
                         {k, fs, j, y - now, kBufX, src_row + now, kBufWs,
                          dst_row + now, fs, fd, r.first + now});
      }
      r.first += y;
      r.rows -= y;
      left -= y;
      if (r.rows == 0) ranges.pop_back();
    }
  }
  return {};
}

std::string ExecutionPlanner::Plan(const int64_t* traffic,
                                   const FastSchedule& schedule,
                                   ExecutionPlan* out) {
  const int n = schedule.num_servers, m = schedule.gpus_per_server;
  const int64_t g = static_cast<int64_t>(n) * m;
  g_ = static_cast<uint64_t>(g);
  out->num_servers = n;
  out->gpus_per_server = m;
  out->num_stages = schedule.num_stages;
  out->ops.clear();
  out->num_phases = 0;
  out->workspace_used.assign(g, 0);
  hold_.clear();
  early_.Size(schedule);
  late_ops_.clear();
  send_off_.assign(g * g, 0);
  recv_off_.assign(g * g, 0);
  for (int64_t s = 0; s < g; ++s) {
    int64_t acc = 0;
    for (int64_t d = 0; d < g; ++d) {
      send_off_[s * g + d] = acc;
      acc += traffic[s * g + d];
    }
  }
  for (int64_t d = 0; d < g; ++d) {
    int64_t acc = 0;
    for (int64_t s = 0; s < g; ++s) {
      recv_off_[s * g + d] = acc;
      acc += traffic[s * g + d];
    }
  }
  if (std::string err = IndexStages(schedule, &stages_); !err.empty()) {
    return err;
  }
  // Rows each balancing row gives: the giver's tail, receivers in stream
  // order from the last row down; they move by use, lowest rows first.
  given_.assign(g * g, 0);
  reserved_.clear();
  for (int64_t i = stages_.begin[0]; i < stages_.end[0]; ++i) {
    const int64_t* row = schedule.transfers.data() + i * kTransferCols;
    const int64_t f = row[kFlowSrc] * g + row[kFlowDst];
    given_[f] += row[kAmount];
    reserved_[Key(row[kDst], row[kFlowSrc], row[kFlowDst])].push_back(
        {traffic[f] - given_[f], row[kAmount]});
  }
  for (int64_t s = 0; s < g; ++s) {
    for (int64_t d = 0; d < g; ++d) {
      const int64_t t = traffic[s * g + d] - given_[s * g + d];
      if (s != d && t > 0) Add(Key(s, s, d), {0, t, kBufX, send_off_[s * g + d], 0});
    }
  }
  for (int64_t s = 0; s < g; ++s) {
    const int64_t t = traffic[s * g + s];
    if (t > 0) {
      out->ops.insert(out->ops.end(), {0, s, s, t, kBufX, send_off_[s * g + s],
                                       kBufOut, recv_off_[s * g + s], s, s, 0});
    }
  }

  std::string err;
  RunStages(
      schedule, stages_,
      [&](const int64_t* row, int64_t phase, int64_t, int64_t rows) {
        err = Apply(row, phase, rows, out);
        return err.empty();
      },
      [&](int k, int64_t phase) {
        err = Balance(schedule, k, phase, out);
        return err.empty();
      });
  if (!err.empty()) return err;
  for (const auto& [key, ranges] : reserved_) {
    if (!ranges.empty()) {
      return "internal error: balancing rows of flow (" +
             std::to_string(key / g_ % g_) + ", " + std::to_string(key % g_) +
             ") for GPU " + std::to_string(key / g_ / g_) + " never move";
    }
  }
  if (!hold_.empty()) {
    const uint64_t key = hold_.begin()->first;
    return "schedule leaves rows of flow (" + std::to_string(key / g_ % g_) +
           ", " + std::to_string(key % g_) + ") on GPU " +
           std::to_string(key / g_ / g_);
  }
  const int64_t k = out->num_ops();
  out->num_phases =
      k == 0 ? 0 : static_cast<int>(out->ops[(k - 1) * kOpCols + kOpPhase]) + 1;
  return {};
}

void ExtractRankProgram(const ExecutionPlan& plan, const int64_t* traffic,
                        int rank, RankProgram* out) {
  const int64_t g =
      static_cast<int64_t>(plan.num_servers) * plan.gpus_per_server;
  const int phases = ProgramPhases(plan.num_stages, plan.gpus_per_server,
                                   plan.num_ops() > 0);
  out->ops.clear();
  out->phase_begin.assign(static_cast<size_t>(phases) + 1, 0);
  int64_t phase = 0;
  for (int64_t i = 0; i < plan.num_ops(); ++i) {
    const int64_t* op = plan.ops.data() + i * kOpCols;
    const bool sends = op[kOpSrc] == rank, recvs = op[kOpDst] == rank;
    if (!sends && !recvs) continue;
    while (phase < op[kOpPhase]) {
      out->phase_begin[++phase] = static_cast<int64_t>(out->ops.size());
    }
    RankOp r;
    r.kind = sends && recvs ? RankOpKind::kCopy
                            : (sends ? RankOpKind::kSend : RankOpKind::kRecv);
    r.peer = static_cast<int>(sends ? op[kOpDst] : op[kOpSrc]);
    r.rows = op[kOpRows];
    r.src_buf = sends ? op[kOpSrcBuf] : kNotMine;
    r.src_row = sends ? op[kOpSrcRow] : kNotMine;
    r.dst_buf = recvs ? op[kOpDstBuf] : kNotMine;
    r.dst_row = recvs ? op[kOpDstRow] : kNotMine;
    out->ops.push_back(r);
  }
  while (phase < phases) {
    out->phase_begin[++phase] = static_cast<int64_t>(out->ops.size());
  }
  out->recv_total = 0;
  for (int64_t s = 0; s < g; ++s) out->recv_total += traffic[s * g + rank];
  out->workspace_used =
      rank < static_cast<int64_t>(plan.workspace_used.size())
          ? plan.workspace_used[rank]
          : 0;
}

//===----------------------------------------------------------------------===//
// RankPlanner
//===----------------------------------------------------------------------===//

std::string RankPlanner::Plan(const int64_t* traffic,
                              const FastSchedule& schedule, int rank,
                              RankProgram* out) {
  n_ = schedule.num_servers;
  m_ = schedule.gpus_per_server;
  g_ = n_ * m_;
  if (rank < 0 || rank >= g_) {
    return "rank " + std::to_string(rank) + " out of range [0, " +
           std::to_string(g_) + ")";
  }
  rank_ = rank;
  server_ = rank / m_;
  traffic_ = traffic;
  if (static_cast<int64_t>(server_of_.size()) != g_ || lane_of_[g_ - 1] != m_ - 1) {
    server_of_.resize(g_);
    lane_of_.resize(g_);
    for (int64_t gpu = 0; gpu < g_; ++gpu) {
      server_of_[gpu] = static_cast<int32_t>(gpu / m_);
      lane_of_[gpu] = static_cast<int32_t>(gpu % m_);
    }
  }
  if (std::string err = IndexStages(schedule, &stages_); !err.empty()) {
    return err;
  }
  Offsets();
  LaneStarts(schedule);
  given_.assign(g_, 0);
  sent_.assign(g_, 0);
  balanced_in_.clear();
  balanced_head_ = 0;
  balanced_late_ = 0;
  early_.Size(schedule);
  relay_.clear();
  relay_head_ = 0;
  late_.clear();
  late_head_ = 0;
  bump_ = 0;
  GiverChunks(schedule);
  chunk_head_ = 0;
  bool any_traffic = schedule.num_stages > 0;
  for (int64_t i = 0; i < g_ * g_ && !any_traffic; ++i) {
    any_traffic = traffic[i] > 0;
  }
  out->ops.clear();
  out->phase_begin.assign(
      static_cast<size_t>(ProgramPhases(schedule.num_stages, m_, any_traffic)) +
          1,
      0);
  phase_ = 0;
  const int64_t local = traffic[rank_ * g_ + rank_];
  if (local > 0) {
    Push(RankOpKind::kCopy, rank_, local, kBufX, send_off_[rank_], kBufOut,
         recv_off_[rank_], 0, out);
  }
  error_.clear();
  if (!RunStages(
          schedule, stages_,
          [&](const int64_t* row, int64_t phase, int64_t first,
              int64_t rows) {
            return Apply(row, phase, first, rows, out);
          },
          [&](int k, int64_t phase) {
            return Balance(schedule, k, phase, out);
          })) {
    return error_;
  }
  for (int64_t d = 0; d < g_; ++d) {
    if (server_of_[d] != server_ &&
        sent_[d] + given_[d] != traffic[rank_ * g_ + d]) {
      return "internal error: rank " + std::to_string(rank_) +
             " keeps rows of flow " + FlowText(rank_, d);
    }
  }
  if (balanced_head_ != balanced_in_.size() || chunk_head_ != chunks_.size()) {
    return "internal error: rank " + std::to_string(rank_) +
           " keeps balancing rows";
  }
  if (relay_head_ != relay_.size() || late_head_ != late_.size()) {
    const Held& h = relay_head_ != relay_.size() ? relay_[relay_head_]
                                                 : late_[late_head_];
    return "internal error: rank " + std::to_string(rank_) +
           " keeps relayed rows of flow " + FlowText(h.flow_src, h.flow_dst);
  }
  const int phases = out->num_phases();
  while (phase_ < phases) {
    out->phase_begin[++phase_] = static_cast<int64_t>(out->ops.size());
  }
  out->recv_total = 0;
  for (int64_t s = 0; s < g_; ++s) out->recv_total += traffic[s * g_ + rank_];
  out->workspace_used = bump_;
  return {};
}

void RankPlanner::Offsets() {
  send_off_.resize(g_);
  recv_off_.resize(g_);
  const int64_t* row = traffic_ + rank_ * g_;
  int64_t acc = 0;
  for (int64_t d = 0; d < g_; ++d) {
    send_off_[d] = acc;
    acc += row[d];
  }
  acc = 0;
  for (int64_t s = 0; s < g_; ++s) {
    recv_off_[s] = acc;
    acc += traffic_[s * g_ + rank_];
  }
}

// lane_row_[s * M + l]: first flow row of (s, rank) that lane l of s's
// server carries.  Lane l's amount is what reaches the rank from its
// scale-out peer (GPU l of the rank's server, the rank itself included);
// the source's lane keeps rows from 0, the receiving lanes get the tail in
// lane order, the lowest lane the last rows.
void RankPlanner::LaneStarts(const FastSchedule& schedule) {
  lane_row_.assign(g_ * m_, 0);
  auto add = [&](const RowBuffer& rows) {
    const int64_t* r = rows.data();
    const int64_t k = static_cast<int64_t>(rows.size()) / kTransferCols;
    for (int64_t i = 0; i < k; ++i, r += kTransferCols) {
      if (r[kStage] >= 2 && r[kDst] == rank_ && r[kFlowDst] == rank_) {
        lane_row_[r[kFlowSrc] * m_ + lane_of_[r[kSrc]]] += r[kAmount];
      }
    }
  };
  add(schedule.transfers);
  add(schedule.redistribution);
  for (int64_t a = 0; a < n_; ++a) {
    if (a == server_) continue;
    for (int64_t own = 0; own < m_; ++own) {
      const int64_t s = a * m_ + own;
      int64_t* lanes = lane_row_.data() + s * m_;
      int64_t top = traffic_[s * g_ + rank_];
      for (int64_t l = 0; l < m_; ++l) {
        if (l == own) continue;
        top -= lanes[l];
        lanes[l] = top;
      }
      lanes[own] = 0;
    }
  }
}

// The balancing rows the rank gives, by use: each balancing row of the
// rank's schedule (r -> j, flow (r, d)) reserves rows of the flow's tail
// (receivers in stream order, from the last row down); lane j sends them
// from its queue (its own units first, then its segment of the pair's
// stream) in the stages whose shares cover their queue positions, and
// each stage's part moves to j the phase before.  chunks_: by stage, in
// stream order within a stage (the whole plan's order: receiving lanes
// ascending, queue order).
void RankPlanner::GiverChunks(const FastSchedule& schedule) {
  chunks_.clear();
  const int64_t* tr = schedule.transfers.data();
  const int64_t gl = lane_of_[rank_];
  int64_t pair = -1, pos = 0;
  have_.resize(m_);
  want_.resize(m_);
  seg_.resize(m_);
  for (int64_t i = stages_.begin[0]; i < stages_.end[0]; ++i) {
    const int64_t* row = tr + i * kTransferCols;
    if (row[kSrc] != rank_) continue;
    const int64_t d = row[kFlowDst], c = server_of_[d], y = row[kAmount];
    if (c != pair) {  // the pair (server_, c): shares, stream, stages
      pair = c;
      int64_t big = 0;
      for (int64_t l = 0; l < m_; ++l) {
        const int64_t* tile = traffic_ + (server_ * m_ + l) * g_ + c * m_;
        int64_t sum = 0;
        for (int64_t h = 0; h < m_; ++h) sum += tile[h];
        have_[l] = sum;
        big += sum;
      }
      const int64_t off = (server_ + c) % m_;
      pos = 0;
      int64_t seg = 0;
      for (int64_t l = 0; l < m_; ++l) {
        const int64_t r = (l - off + m_) % m_;
        want_[l] = big / m_ + (r < big % m_ ? 1 : 0);
        if (l < gl) pos += std::max<int64_t>(have_[l] - want_[l], 0);
        seg_[l] = seg;
        seg += std::max<int64_t>(want_[l] - have_[l], 0);
      }
      pair_stages_.clear();
      int64_t sent = 0;
      for (int k = 0; k < schedule.num_stages; ++k) {
        const size_t at = static_cast<size_t>(k) * n_ + server_;
        if (schedule.matchings[at] != c || schedule.real[at] == 0) continue;
        sent += schedule.real[at];
        pair_stages_.push_back({k, sent});
      }
    }
    given_[d] += y;
    const int64_t first = traffic_[rank_ * g_ + d] - given_[d];
    const int64_t j = lane_of_[row[kDst]];
    const int64_t q0 = have_[j] + (pos - seg_[j]);
    pos += y;
    const int64_t rj = (j - (server_ + c) % m_ + m_) % m_;
    const auto units = [&](int64_t sent) { return (sent + m_ - 1 - rj) / m_; };
    int64_t lo = 0;
    for (const auto& [k, sent] : pair_stages_) {
      const int64_t hi = units(sent);
      const int64_t b = std::max(lo, q0), e = std::min(hi, q0 + y);
      if (b < e) {
        chunks_.push_back({k, row[kDst], e - b,
                           send_off_[d] + first + (b - q0)});
      }
      lo = hi;
      if (lo >= q0 + y) break;
    }
  }
  std::stable_sort(chunks_.begin(), chunks_.end(),
                   [](const Chunk& x, const Chunk& y) {
                     return x.stage < y.stage;
                   });
}

// The balancing by use of BvN stage k in `phase`: the rank's chunks as a
// giver, or, as a receiving lane, what its own stage-k scale-out rows send
// of other GPUs' flows (into its workspace, sent on in stage k).  Stage
// k > 1 in two parts (ExecutionPlanner::Balance): in phase k - 1 the
// early rows of each chunk and row, with the row's whole workspace; in
// phase k the rest.
bool RankPlanner::Balance(const FastSchedule& schedule, int k, int64_t phase,
                          RankProgram* out) {
  const bool split = k >= 2;
  const bool late = split && phase == k;
  size_t c = chunk_head_;
  for (; c < chunks_.size() && chunks_[c].stage == k; ++c) {
    const Chunk& chunk = chunks_[c];
    const int64_t early = split ? early_.Rows(chunk.rows, k) : 0;
    const int64_t rows = late ? chunk.rows - early
                              : (split ? early : chunk.rows);
    if (rows > 0) {
      Push(RankOpKind::kSend, chunk.peer, rows, kBufX,
           chunk.src_row + (late ? early : 0), kNotMine, kNotMine, phase,
           out);
    }
  }
  if (late || !split) chunk_head_ = c;
  const int64_t st = 2 + 2 * static_cast<int64_t>(k);
  const int64_t* tr = schedule.transfers.data();
  if (!late) balanced_late_ = balanced_in_.size();
  size_t held = balanced_late_;
  for (int64_t i = stages_.begin[st]; i < stages_.end[st]; ++i) {
    const int64_t* row = tr + i * kTransferCols;
    if (row[kSrc] != rank_ || row[kFlowSrc] == rank_) continue;
    const int64_t amount = row[kAmount];
    const int64_t early = split ? early_.Rows(amount, k) : 0;
    if (late) {
      const Held& h = balanced_in_[held++];
      if (amount > early) {
        Push(RankOpKind::kRecv, row[kFlowSrc], amount - early, kNotMine,
             kNotMine, kBufWs, h.row + early, phase, out);
      }
      continue;
    }
    const int64_t rows = split ? early : amount;
    if (rows > 0) {
      Push(RankOpKind::kRecv, row[kFlowSrc], rows, kNotMine, kNotMine,
           kBufWs, bump_, phase, out);
    }
    balanced_in_.push_back({row[kFlowSrc], row[kFlowDst], kBufWs, bump_,
                            amount, k + 1});
    bump_ += amount;
  }
  return true;
}

void RankPlanner::Push(RankOpKind kind, int64_t peer, int64_t rows,
                       int64_t src_buf, int64_t src_row, int64_t dst_buf,
                       int64_t dst_row, int64_t phase, RankProgram* out) {
  while (phase_ < phase) {
    out->phase_begin[++phase_] = static_cast<int64_t>(out->ops.size());
  }
  // Field by field into place: a temporary built from narrow stores and
  // copied with wide loads stalls on store forwarding.
  RankOp& op = out->ops.emplace_back();
  op.kind = kind;
  op.peer = static_cast<int>(peer);
  op.rows = rows;
  op.src_buf = src_buf;
  op.src_row = src_row;
  op.dst_buf = dst_buf;
  op.dst_row = dst_row;
}

bool RankPlanner::Fail(std::string why) {
  error_ = "internal error: rank " + std::to_string(rank_) + " " + why;
  return false;
}

bool RankPlanner::Apply(const int64_t* row, int64_t phase, int64_t first,
                        int64_t rows, RankProgram* out) {
  if (phase >= out->num_phases()) {
    return Fail("has a row in phase " + std::to_string(phase) + " of " +
                std::to_string(out->num_phases()));
  }
  if (row[kStage] == 1) return Intra(row, phase, first, rows, out);
  if (row[kSrc] == rank_) return Send(row, phase, first, rows, out);
  if (row[kDst] == rank_) return Receive(row, phase, rows, out);
  return Fail("has a row of GPUs " + std::to_string(row[kSrc]) + " -> " +
              std::to_string(row[kDst]));
}

// Rows [first, first + rows) of an intra-server flow, x to out.
bool RankPlanner::Intra(const int64_t* row, int64_t phase, int64_t first,
                        int64_t rows, RankProgram* out) {
  const int64_t fs = row[kFlowSrc], fd = row[kFlowDst];
  if (fs == rank_ && row[kSrc] == rank_) {
    Push(RankOpKind::kSend, fd, rows, kBufX, send_off_[fd] + first, kNotMine,
         kNotMine, phase, out);
    return true;
  }
  if (fd == rank_ && row[kDst] == rank_) {
    Push(RankOpKind::kRecv, fs, rows, kNotMine, kNotMine, kBufOut,
         recv_off_[fs] + first, phase, out);
    return true;
  }
  return Fail("has intra-server rows of flow " + FlowText(fs, fd));
}

bool RankPlanner::Send(const int64_t* row, int64_t phase, int64_t first,
                       int64_t rows, RankProgram* out) {
  const int64_t stage = row[kStage], peer = row[kDst];
  const int64_t fs = row[kFlowSrc], fd = row[kFlowDst];
  const auto lost = [&] {
    return Fail("sends " + std::to_string(rows) + " rows of flow " +
                FlowText(fs, fd) + " in phase " + std::to_string(phase) +
                " that it does not hold next");
  };
  if (stage % 2 == 0) {
    if (fs == rank_) {  // its own flow, from the first rows not yet sent
      if (sent_[fd] + rows + given_[fd] > traffic_[rank_ * g_ + fd]) {
        return lost();
      }
      Push(RankOpKind::kSend, peer, rows, kBufX, send_off_[fd] + sent_[fd],
           kNotMine, kNotMine, phase, out);
      sent_[fd] += rows;
      return true;
    }
    // Balanced rows: what arrived for this row the phase before.
    if (balanced_head_ == balanced_in_.size()) return lost();
    const Held& h = balanced_in_[balanced_head_];
    if (h.flow_src != fs || h.flow_dst != fd || h.rows != rows ||
        h.ready > phase) {
      return lost();
    }
    Push(RankOpKind::kSend, peer, rows, h.buf, h.row, kNotMine, kNotMine,
         phase, out);
    ++balanced_head_;
    return true;
  }
  // Redistribution: the head of the oldest scale-out piece (its tail
  // waits in late_ for the row's second part), or the oldest such tail.
  if (first > 0) {
    if (late_head_ == late_.size()) return lost();
    const Held& h = late_[late_head_];
    if (h.flow_src != fs || h.flow_dst != fd || h.rows != rows ||
        h.ready > phase) {
      return lost();
    }
    Push(RankOpKind::kSend, peer, rows, h.buf, h.row, kNotMine, kNotMine,
         phase, out);
    ++late_head_;
    return true;
  }
  if (relay_head_ == relay_.size()) return lost();
  const Held& h = relay_[relay_head_];
  if (h.flow_src != fs || h.flow_dst != fd || h.rows != row[kAmount] ||
      rows > h.rows || h.ready > phase) {
    return lost();
  }
  Push(RankOpKind::kSend, peer, rows, h.buf, h.row, kNotMine, kNotMine, phase,
       out);
  if (rows < h.rows) {
    Held& rest = late_.emplace_back(h);
    rest.row += rows;
    rest.rows -= rows;
  }
  ++relay_head_;
  return true;
}

bool RankPlanner::Receive(const int64_t* row, int64_t phase, int64_t rows,
                          RankProgram* out) {
  const int64_t stage = row[kStage], peer = row[kSrc];
  const int64_t fs = row[kFlowSrc], fd = row[kFlowDst];
  const bool scale_out = stage >= 2 && stage % 2 == 0;
  if (fd == rank_ && stage >= 2) {
    int64_t& next = lane_row_[fs * m_ + lane_of_[peer]];
    const int64_t first = next;
    next += rows;
    Push(RankOpKind::kRecv, peer, rows, kNotMine, kNotMine, kBufOut,
         recv_off_[fs] + first, phase, out);
    return true;
  }
  if (fd == rank_ || !scale_out) {
    return Fail("receives rows of flow " + FlowText(fs, fd) + " in stage " +
                std::to_string(stage));
  }
  Push(RankOpKind::kRecv, peer, rows, kNotMine, kNotMine, kBufWs, bump_, phase,
       out);
  Held& h = relay_.emplace_back();
  h.flow_src = fs;
  h.flow_dst = fd;
  h.buf = kBufWs;
  h.row = bump_;
  h.rows = rows;
  h.ready = phase + 1;
  bump_ += rows;
  return true;
}

// What CheckTraffic reports, found entry by entry.
static std::string TrafficError(const int64_t* traffic, int64_t g,
                                int64_t rows_in, int64_t rows_out) {
  for (int64_t s = 0; s < g; ++s) {
    int64_t sum = 0;
    for (int64_t d = 0; d < g; ++d) {
      const int64_t t = traffic[s * g + d];
      if (t < 0) {
        return "traffic[" + std::to_string(s) + ", " + std::to_string(d) +
               "] = " + std::to_string(t) + " is negative";
      }
      sum += t;
    }
    if (sum > rows_in) {
      return "rank " + std::to_string(s) + " sends " + std::to_string(sum) +
             " rows but x has " + std::to_string(rows_in);
    }
  }
  for (int64_t d = 0; d < g; ++d) {
    int64_t sum = 0;
    for (int64_t s = 0; s < g; ++s) sum += traffic[s * g + d];
    if (sum > rows_out) {
      return "rank " + std::to_string(d) + " receives " + std::to_string(sum) +
             " rows but out has " + std::to_string(rows_out);
    }
  }
  return {};
}

std::string CheckTraffic(const int64_t* traffic, int64_t g, int64_t rows_in,
                         int64_t rows_out) {
  // One pass in memory order (column sums in an accumulator); the message,
  // if any, comes from the slower TrafficError.
  std::vector<int64_t> cols(g, 0);
  int64_t sign = 0;
  bool fits = true;
  for (int64_t s = 0; s < g; ++s) {
    const int64_t* row = traffic + s * g;
    int64_t sum = 0;
    for (int64_t d = 0; d < g; ++d) {
      sum += row[d];
      cols[d] += row[d];
      sign |= row[d];
    }
    fits &= sum <= rows_in;
  }
  for (int64_t d = 0; d < g; ++d) fits &= cols[d] <= rows_out;
  if (sign >= 0 && fits) return {};
  return TrafficError(traffic, g, rows_in, rows_out);
}

std::string StagedPlanner::BuildOwned(int num_servers, int gpus_per_server,
                                      int64_t rows_in, int64_t rows_out) {
  const int64_t g = static_cast<int64_t>(num_servers) * gpus_per_server;
  if (std::string err = CheckTraffic(traffic_.data(), g, rows_in, rows_out);
      !err.empty()) {
    return err;
  }
  if (std::string err = scheduler_.Schedule(traffic_.data(), num_servers,
                                            gpus_per_server, true, &schedule_);
      !err.empty()) {
    return err;
  }
  return planner_.Plan(traffic_.data(), schedule_, &plan_);
}

int64_t WorkspaceBound(int64_t rows_in, int64_t rows_out, int num_servers,
                       int gpus_per_server) {
  if (num_servers <= 1 || gpus_per_server <= 1) return 0;
  const int64_t slack = 2 * (static_cast<int64_t>(num_servers) - 1);
  if (rows_in > INT64_MAX - slack - rows_out) return INT64_MAX;
  return rows_in + rows_out + slack;
}

std::string CheckProgram(const RankProgram& program, int64_t rows_in,
                         int64_t rows_out, int64_t ws_rows) {
  const auto inside = [](int64_t row, int64_t rows, int64_t size) {
    return row >= 0 && row <= size - rows;
  };
  for (size_t i = 0; i < program.ops.size(); ++i) {
    const RankOp& op = program.ops[i];
    const bool reads = op.kind != RankOpKind::kRecv;
    const bool writes = op.kind != RankOpKind::kSend;
    const int64_t src_size = op.src_buf == kBufWs ? ws_rows : rows_in;
    const int64_t dst_size = op.dst_buf == kBufWs ? ws_rows : rows_out;
    if (op.rows < 1 || (reads && !inside(op.src_row, op.rows, src_size)) ||
        (writes && !inside(op.dst_row, op.rows, dst_size))) {
      return "internal error: op " + std::to_string(i) +
             " of the rank's program falls outside the buffers";
    }
  }
  return {};
}

PlanStatus StagedPlanner::BuildRankOwned(int num_servers, int gpus_per_server,
                                         int64_t rows_in, int64_t rows_out,
                                         int64_t ws_rows, int rank,
                                         RankProgram* out) {
  const int64_t g = static_cast<int64_t>(num_servers) * gpus_per_server;
  if (rank < 0 || rank >= g) {
    return {PlanFailure::kInternal, "rank " + std::to_string(rank) +
                                        " out of range [0, " +
                                        std::to_string(g) + ")"};
  }
  if (std::string err = CheckTraffic(traffic_.data(), g, rows_in, rows_out);
      !err.empty()) {
    return {PlanFailure::kTraffic, err};
  }
  if (ws_rows < WorkspaceBound(rows_in, rows_out, num_servers,
                               gpus_per_server)) {
    if (PlanStatus s = CheckWorkspaceUse(num_servers, gpus_per_server, ws_rows);
        !s.ok()) {
      return s;
    }
  }
  if (std::string err =
          scheduler_.Schedule(traffic_.data(), num_servers, gpus_per_server,
                              true, &schedule_, rank);
      !err.empty()) {
    return {PlanFailure::kTraffic, err};
  }
  if (std::string err =
          rank_planner_.Plan(traffic_.data(), schedule_, rank, out);
      !err.empty()) {
    return {PlanFailure::kInternal, err};
  }
  if (std::string err = CheckProgram(*out, rows_in, rows_out, ws_rows);
      !err.empty()) {
    return {PlanFailure::kInternal, err};
  }
  return {};
}

// Workspace rows each GPU's plan uses: what it relays (the balancing rows
// it receives, the scale-out rows it receives for another GPU), which is
// bump-allocated and never reused, so their sum.
void WorkspaceUse(const FastSchedule& schedule, std::vector<int64_t>* use) {
  const int64_t g =
      static_cast<int64_t>(schedule.num_servers) * schedule.gpus_per_server;
  use->assign(g, 0);
  const int64_t* r = schedule.transfers.data();
  const int64_t k =
      static_cast<int64_t>(schedule.transfers.size()) / kTransferCols;
  for (int64_t i = 0; i < k; ++i, r += kTransferCols) {
    const int64_t st = r[kStage];
    if (st == 0 || (st >= 2 && r[kDst] != r[kFlowDst])) {
      (*use)[r[kDst]] += r[kAmount];
    }
  }
}

// Below the proven bound a rank cannot know from its own part whether
// every rank fits, so every rank builds the full schedule (ranges form)
// and checks each GPU's workspace use before planning its own program.
PlanStatus StagedPlanner::CheckWorkspaceUse(int num_servers,
                                            int gpus_per_server,
                                            int64_t ws_rows) {
  if (std::string err = scheduler_.ScheduleRanges(
          traffic_.data(), num_servers, gpus_per_server, &schedule_);
      !err.empty()) {
    return {PlanFailure::kTraffic, err};
  }
  WorkspaceUseOfRanges(traffic_.data(), schedule_, &use_);
  for (size_t g = 0; g < use_.size(); ++g) {
    if (use_[g] > ws_rows) {
      return {PlanFailure::kWorkspace,
              "rank " + std::to_string(g) + " needs " +
                  std::to_string(use_[g]) +
                  " workspace rows, the workspace has " +
                  std::to_string(ws_rows)};
    }
  }
  return {};
}

std::string StagedPlanner::ForRank(int rank, int64_t ws_rows,
                                   RankProgram* out) const {
  const int64_t g =
      static_cast<int64_t>(plan_.num_servers) * plan_.gpus_per_server;
  if (rank < 0 || rank >= g) {
    return "rank " + std::to_string(rank) + " out of range [0, " +
           std::to_string(g) + ")";
  }
  ExtractRankProgram(plan_, traffic_.data(), rank, out);
  if (out->workspace_used > ws_rows) {
    return "rank " + std::to_string(rank) + " needs " +
           std::to_string(out->workspace_used) +
           " workspace rows, the workspace has " + std::to_string(ws_rows);
  }
  return {};
}

}  // namespace moe_jax::fast

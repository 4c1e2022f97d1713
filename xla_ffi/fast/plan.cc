#include "xla_ffi/fast/plan.h"

#include <algorithm>

namespace moe_jax::fast {

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
                                    ExecutionPlan* out) {
  const int64_t src = row[kSrc], dst = row[kDst];
  const int64_t fs = row[kFlowSrc], fd = row[kFlowDst];
  if (std::string err = Take(Key(src, fs, fd), row[kAmount],
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

std::string ExecutionPlanner::Plan(const int64_t* traffic,
                                   const FastSchedule& schedule,
                                   ExecutionPlan* out) {
  const int n = schedule.num_servers, m = schedule.gpus_per_server;
  const int64_t g = static_cast<int64_t>(n) * m;
  g_ = static_cast<uint64_t>(g);
  out->num_servers = n;
  out->gpus_per_server = m;
  out->ops.clear();
  out->num_phases = 0;
  out->workspace_used.assign(g, 0);
  hold_.clear();
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
  for (int64_t s = 0; s < g; ++s) {
    for (int64_t d = 0; d < g; ++d) {
      const int64_t t = traffic[s * g + d];
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

  // Row ranges of each stage: transfers holds stages 0, 1, 2, 4, ... in
  // order, redistribution stages 3, 5, ...
  const int S = schedule.num_stages;
  const int64_t* tr = schedule.transfers.data();
  const int64_t* rd = schedule.redistribution.data();
  const int64_t nt = static_cast<int64_t>(schedule.transfers.size()) / kTransferCols;
  const int64_t nr =
      static_cast<int64_t>(schedule.redistribution.size()) / kTransferCols;
  std::vector<int64_t> begin(2 * static_cast<size_t>(S) + 3, 0);
  std::vector<int64_t> end(begin.size(), 0);
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t st = tr[i * kTransferCols + kStage];
    if (st < 0 || st >= static_cast<int64_t>(begin.size()) || (st >= 2 && st % 2)) {
      return "internal error: schedule row with stage " + std::to_string(st);
    }
    if (end[st] == 0) begin[st] = i;
    end[st] = i + 1;
  }
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t st = rd[i * kTransferCols + kStage];
    if (st < 3 || st >= static_cast<int64_t>(begin.size()) || st % 2 == 0) {
      return "internal error: redistribution row with stage " +
             std::to_string(st);
    }
    if (end[st] == 0) begin[st] = i;
    end[st] = i + 1;
  }
  auto run = [&](int64_t st, int64_t phase) -> std::string {
    const int64_t* rows = st >= 3 && st % 2 ? rd : tr;
    for (int64_t i = begin[st]; i < end[st]; ++i) {
      if (std::string err = Apply(rows + i * kTransferCols, phase, out);
          !err.empty()) {
        return err;
      }
    }
    return {};
  };
  std::string err = run(0, 0);
  if (S == 0) {
    if (err.empty()) err = run(1, 0);
  } else {
    if (err.empty()) err = run(2, 1);
    if (err.empty()) err = run(1, 1);
    for (int k = 0; k < S && err.empty(); ++k) {
      err = run(3 + 2 * static_cast<int64_t>(k), k + 2);
      if (err.empty() && k + 1 < S) {
        err = run(2 + 2 * static_cast<int64_t>(k + 1), k + 2);
      }
    }
  }
  if (!err.empty()) return err;
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
  out->ops.clear();
  out->phase_begin.assign(static_cast<size_t>(plan.num_phases) + 1, 0);
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
    r.src_buf = op[kOpSrcBuf];
    r.src_row = op[kOpSrcRow];
    r.dst_buf = op[kOpDstBuf];
    r.dst_row = op[kOpDstRow];
    out->ops.push_back(r);
  }
  while (phase < plan.num_phases) {
    out->phase_begin[++phase] = static_cast<int64_t>(out->ops.size());
  }
  out->recv_total = 0;
  for (int64_t s = 0; s < g; ++s) out->recv_total += traffic[s * g + rank];
  out->workspace_used =
      rank < static_cast<int64_t>(plan.workspace_used.size())
          ? plan.workspace_used[rank]
          : 0;
}

std::string CheckTraffic(const int64_t* traffic, int64_t g, int64_t rows_in,
                         int64_t rows_out) {
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

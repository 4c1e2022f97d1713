// Execution plan of a FAST schedule (plain C++17, no XLA, no CUDA).
//
// Same algorithm, op order and row choice as moe_jax/fast/plan.py, which
// documents it: the schedule is replayed on per-GPU holdings and every
// transfer becomes ops that move one contiguous row range of one flow
// between buffers (x -> out / ws, ws -> out / ws), grouped into phases that
// may run concurrently (phase 0: local copies and balancing; phase k + 1:
// scale-out of Birkhoff-von Neumann stage k, redistribution of stage k - 1,
// and in phase 1 the intra-server part).  Relayed rows are bump-allocated
// in a per-GPU workspace and never overwritten.
//
// ExtractRankProgram selects what one rank issues; issue.h issues it
// through a transport (NCCL in cuda/fast_staged_all_to_all.cc, an
// in-memory simulation in simulate.cc).
#ifndef MOE_JAX_XLA_FFI_FAST_PLAN_H_
#define MOE_JAX_XLA_FFI_FAST_PLAN_H_

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "xla_ffi/fast/scheduler.h"

namespace moe_jax::fast {

// Columns of ExecutionPlan::ops (row-major, kOpCols per op).
enum OpCol : int {
  kOpPhase = 0, kOpSrc, kOpDst, kOpRows, kOpSrcBuf, kOpSrcRow, kOpDstBuf,
  kOpDstRow, kOpFlowSrc, kOpFlowDst, kOpFlowRow, kOpCols
};
// Buffer codes: a source is x or ws, a destination out or ws.
constexpr int64_t kBufX = 0;
constexpr int64_t kBufOut = 0;
constexpr int64_t kBufWs = 1;

struct ExecutionPlan {
  int num_servers = 0;
  int gpus_per_server = 0;
  std::vector<int64_t> ops;             // [K * kOpCols], phases non-decreasing
  int num_phases = 0;                   // 1 + largest phase (0 without ops)
  std::vector<int64_t> workspace_used;  // [G] workspace rows per GPU
  int64_t num_ops() const {
    return static_cast<int64_t>(ops.size()) / kOpCols;
  }
};

class ExecutionPlanner {
 public:
  // traffic: row-major int64[G * G] (the one `schedule` was built from with
  // with_transfers=true and gpu=-1).  Returns "" on success, else why not.
  std::string Plan(const int64_t* traffic, const FastSchedule& schedule,
                   ExecutionPlan* out);

 private:
  struct Segment {
    int64_t flow_row, rows, buf, row, ready;
  };
  struct Piece {
    int64_t flow_row, rows, buf, row;
  };
  uint64_t Key(int64_t gpu, int64_t fs, int64_t fd) const {
    return (static_cast<uint64_t>(gpu) * g_ + fs) * g_ + fd;
  }
  void Add(uint64_t key, const Segment& s);
  std::string Take(uint64_t key, int64_t amount, bool from_tail, int64_t phase,
                   int64_t gpu, int64_t fs, int64_t fd);
  std::string Apply(const int64_t* row, int64_t phase, ExecutionPlan* out);

  uint64_t g_ = 0;
  std::unordered_map<uint64_t, std::vector<Segment>> hold_;
  std::vector<Piece> pieces_;
  std::vector<int64_t> send_off_, recv_off_;
};

enum class RankOpKind : int { kCopy, kSend, kRecv };

// One op as a rank issues it.  kSend: rows [src_row, src_row + rows) of
// src_buf (x / ws) to `peer`.  kRecv: from `peer` into rows [dst_row, ...)
// of dst_buf (out / ws).  kCopy: local, src_buf/src_row -> dst_buf/dst_row.
struct RankOp {
  RankOpKind kind;
  int peer;
  int64_t rows;
  int64_t src_buf, src_row;
  int64_t dst_buf, dst_row;
};

struct RankProgram {
  std::vector<RankOp> ops;           // plan order
  std::vector<int64_t> phase_begin;  // [num_phases + 1] into ops
  int64_t recv_total = 0;            // out rows written (sum of column)
  int64_t workspace_used = 0;
  int num_phases() const {
    return static_cast<int>(phase_begin.size()) - 1;
  }
};

// The ops `rank` sends, receives or copies, by phase (every rank gets the
// same number of phases, also when some are empty for it).
void ExtractRankProgram(const ExecutionPlan& plan, const int64_t* traffic,
                        int rank, RankProgram* out);

// "" if traffic (int64[G * G]) is non-negative with every row sum <= rows_in
// and every column sum <= rows_out, else what is wrong.
std::string CheckTraffic(const int64_t* traffic, int64_t g, int64_t rows_in,
                         int64_t rows_out);

// Traffic matrix -> one rank's program, with buffers kept between calls
// (one per thread: the CUDA custom call keeps a thread_local one).
class StagedPlanner {
 public:
  // Checks the traffic against the buffer sizes, schedules and plans.
  // traffic: row-major int32 or int64 [G * G], G = num_servers * M.
  template <typename Count>
  std::string Build(const Count* traffic, int num_servers, int gpus_per_server,
                    int64_t rows_in, int64_t rows_out) {
    if (num_servers < 1 || gpus_per_server < 1) {
      return "num_servers and gpus_per_server must be >= 1";
    }
    const int64_t g = static_cast<int64_t>(num_servers) * gpus_per_server;
    traffic_.assign(traffic, traffic + g * g);
    return BuildOwned(num_servers, gpus_per_server, rows_in, rows_out);
  }
  // Rank `rank`'s program of the last Build; fails when it needs more than
  // ws_rows workspace rows.
  std::string ForRank(int rank, int64_t ws_rows, RankProgram* out) const;
  const ExecutionPlan& plan() const { return plan_; }
  const std::vector<int64_t>& traffic() const { return traffic_; }

 private:
  std::string BuildOwned(int num_servers, int gpus_per_server,
                         int64_t rows_in, int64_t rows_out);
  std::vector<int64_t> traffic_;
  FastScheduler scheduler_;
  FastSchedule schedule_;
  ExecutionPlanner planner_;
  ExecutionPlan plan_;
};

}  // namespace moe_jax::fast

#endif  // MOE_JAX_XLA_FFI_FAST_PLAN_H_

// Execution plan of a FAST schedule (plain C++17, no XLA, no CUDA).
//
// Same algorithm, op order and row choice as moe_jax/fast/plan.py, which
// documents it: the schedule is replayed on per-GPU holdings and every
// transfer becomes ops that move one contiguous row range of one flow
// between buffers (x -> out / ws, ws -> out / ws), grouped into phases that
// may run concurrently (phase 0: local copies and balancing; phase k + 1:
// scale-out of Birkhoff-von Neumann stage k, stage k's share of the
// intra-server part, redistribution of stage k - 1, balancing of stage
// k + 1).  Relayed rows are bump-allocated
// in a per-GPU workspace and never overwritten.
//
// ExtractRankProgram selects what one rank issues from the whole plan;
// RankPlanner builds the same program from that rank's per-GPU schedule
// alone (what StagedPlanner::BuildRank runs on each rank); issue.h issues
// it through a transport (NCCL in cuda/fast_staged_all_to_all.cc, an
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
  int num_stages = 0;                   // BvN stages of the schedule
  std::vector<int64_t> workspace_used;  // [G] workspace rows per GPU
  int64_t num_ops() const {
    return static_cast<int64_t>(ops.size()) / kOpCols;
  }
};

// Where each stage's rows lie in a schedule's two row arrays (transfers:
// stages 0, 1, 2, 4, ... in order; redistribution: 3, 5, ...); kept by the
// planners so that indexing does not allocate.
struct StageIndex {
  std::vector<int64_t> begin, end;
};

// How much of each BvN stage's balancing by use runs a phase early
// (plan.py's balancing_early): Rows(amount, k) of a use of `amount` rows
// of stage k move in phase k - 1, the rest in phase k.
class BalancingEarly {
 public:
  void Size(const FastSchedule& schedule);
  int64_t Rows(int64_t amount, int k) const;

 private:
  std::vector<int64_t> room_, need_, early_;
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
  // `rows` of the row's units (fewer for a stage's share of an
  // intra-server flow).
  std::string Apply(const int64_t* row, int64_t phase, int64_t rows,
                    ExecutionPlan* out);
  std::string Balance(const FastSchedule& schedule, int k, int64_t phase,
                      ExecutionPlan* out);
  struct Range {
    int64_t first, rows;
  };

  uint64_t g_ = 0;
  StageIndex stages_;
  std::unordered_map<uint64_t, std::vector<Segment>> hold_;
  std::vector<Piece> pieces_;
  std::vector<int64_t> send_off_, recv_off_;
  std::vector<int64_t> given_;  // [G * G] rows of each flow given away
  // (receiver, flow) -> rows reserved for it, lowest last.
  std::unordered_map<uint64_t, std::vector<Range>> reserved_;
  BalancingEarly early_;
  // Ops of the stage whose balancing started early, for its own phase.
  std::vector<int64_t> late_ops_;
};

enum class RankOpKind : int { kCopy, kSend, kRecv };

// One op as a rank issues it.  kSend: rows [src_row, src_row + rows) of
// src_buf (x / ws) to `peer`.  kRecv: from `peer` into rows [dst_row, ...)
// of dst_buf (out / ws).  kCopy: local, src_buf/src_row -> dst_buf/dst_row.
// The peer's side of a send or receive is not the rank's: its buffer and
// row are kNotMine.
constexpr int64_t kNotMine = -1;
struct RankOp {
  RankOpKind kind;
  int peer;
  int64_t rows;
  int64_t src_buf, src_row;
  int64_t dst_buf, dst_row;
};

// Phases of every rank's program: with S > 0 BvN stages, 0 .. S + 1 (the
// last redistribution's), 0 .. S with one GPU per server (no
// redistribution); else one phase, none without traffic.  The server-level
// schedule fixes it, so each rank knows it without the others' rows; the
// last phases may be empty for every rank.
int ProgramPhases(int num_stages, int gpus_per_server, bool any_traffic);

struct RankProgram {
  std::vector<RankOp> ops;           // plan order
  std::vector<int64_t> phase_begin;  // [ProgramPhases + 1] into ops
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

// Builds one rank's program from its per-GPU schedule (FastScheduler with
// gpu = rank): the same ops in the same order as ExtractRankProgram of the
// whole plan.  The rank's own rows suffice because
// * every schedule row is one op (one contiguous range of one flow): a
//   source holds its flow in one x range, a balancing receiver gets one
//   piece of a flow, a scale-out peer forwards each piece in its stage;
// * what the rank relays sits in its own workspace, bump-allocated over its
//   own receives in plan order, and leaves in its lane queue's order (own
//   kept pieces, then the balancing pieces it received) or, at the
//   scale-out peer, in the order it arrived;
// * out rows are recv_off + flow row, and the flow rows each lane carries
//   follow from the balancing rule: the source keeps the first rows of its
//   flow, its tail goes to receiving lanes in lane order from the last row
//   down, and every unit a lane carries reaches the destination from that
//   lane's scale-out peer, so the destination's own receives give each
//   lane's amount.
class RankPlanner {
 public:
  // traffic: row-major int64[G * G], the one `schedule` was built from with
  // with_transfers=true and gpu=rank.  "" on success, else why not.
  std::string Plan(const int64_t* traffic, const FastSchedule& schedule,
                   int rank, RankProgram* out);

 private:
  // Rows of a flow the rank holds until it sends them on.
  struct Held {
    int64_t flow_src, flow_dst, buf, row, rows, ready;
  };
  void Offsets();
  void LaneStarts(const FastSchedule& schedule);
  void GiverChunks(const FastSchedule& schedule);
  bool Balance(const FastSchedule& schedule, int k, int64_t phase,
               RankProgram* out);
  // Apply, Intra, Send and Receive return false after Fail set error_.
  bool Apply(const int64_t* row, int64_t phase, int64_t first, int64_t rows,
             RankProgram* out);
  bool Intra(const int64_t* row, int64_t phase, int64_t first, int64_t rows,
             RankProgram* out);
  bool Send(const int64_t* row, int64_t phase, int64_t first, int64_t rows,
            RankProgram* out);
  bool Receive(const int64_t* row, int64_t phase, int64_t rows,
               RankProgram* out);
  bool Fail(std::string why);
  void Push(RankOpKind kind, int64_t peer, int64_t rows, int64_t src_buf,
            int64_t src_row, int64_t dst_buf, int64_t dst_row, int64_t phase,
            RankProgram* out);

  int64_t g_ = 0, m_ = 0, n_ = 0, rank_ = 0, server_ = 0;
  const int64_t* traffic_ = nullptr;
  // Server and local index of each GPU (no divisions per row).
  std::vector<int32_t> server_of_, lane_of_;
  StageIndex stages_;
  std::string error_;
  std::vector<int64_t> send_off_;   // [G] first x row of flow (rank, d)
  std::vector<int64_t> recv_off_;   // [G] first out row of flow (s, rank)
  std::vector<int64_t> given_;      // [G] units of (rank, d) given away
  // [G * M]: next flow row of (s, rank) that lane l of s's server carries.
  std::vector<int64_t> lane_row_;
  std::vector<int64_t> sent_;       // [G] rows of (rank, d) sent by itself
  // Balancing rows received (by use), sent on in this order.
  std::vector<Held> balanced_in_;
  size_t balanced_head_ = 0;
  // First of them that the stage balanced early still completes.
  size_t balanced_late_ = 0;
  BalancingEarly early_;
  // Balancing rows the rank gives, by stage (GiverChunks).
  struct Chunk {
    int stage;
    int64_t peer, rows, src_row;
  };
  std::vector<Chunk> chunks_;
  size_t chunk_head_ = 0;
  std::vector<int64_t> have_, want_, seg_;  // [M] of one server pair
  struct PairStage {
    int stage;
    int64_t sent;  // the pair's units sent up to and with this stage
  };
  std::vector<PairStage> pair_stages_;
  std::vector<Held> relay_;         // scale-out pieces to redistribute
  size_t relay_head_ = 0;
  std::vector<Held> late_;          // their tails, sent a phase later
  size_t late_head_ = 0;
  int64_t bump_ = 0;                // workspace rows used
  int64_t phase_ = 0;               // phase of the last op pushed
};

// Rows of workspace that suffice on every GPU for any traffic within the
// buffers (moe_jax/fast/plan.py's workspace_rows; saturates at INT64_MAX).
int64_t WorkspaceBound(int64_t rows_in, int64_t rows_out, int num_servers,
                       int gpus_per_server);

// "" if every op of the program stays inside buffers of these sizes.
std::string CheckProgram(const RankProgram& program, int64_t rows_in,
                         int64_t rows_out, int64_t ws_rows);

// "" if traffic (int64[G * G]) is non-negative with every row sum <= rows_in
// and every column sum <= rows_out, else what is wrong.
std::string CheckTraffic(const int64_t* traffic, int64_t g, int64_t rows_in,
                         int64_t rows_out);

// Why StagedPlanner::BuildRank failed (kNone: it did not).
enum class PlanFailure : int { kNone, kTraffic, kWorkspace, kInternal };
struct PlanStatus {
  PlanFailure failure = PlanFailure::kNone;
  std::string message;
  bool ok() const { return failure == PlanFailure::kNone; }
};

// Workspace rows each GPU's plan uses (ExecutionPlan::workspace_used),
// from a full schedule's rows alone.
void WorkspaceUse(const FastSchedule& schedule, std::vector<int64_t>* use);

// Traffic matrix -> one rank's program, with buffers kept between calls
// (one per thread: the CUDA custom call keeps a thread_local one).
class StagedPlanner {
 public:
  // One rank's program, as that rank builds it (every rank decides alike:
  // the traffic check and the workspace decision use only what all ranks
  // share).  With ws_rows >= WorkspaceBound no rank can run out of
  // workspace, so only `rank`'s per-GPU schedule is built and planned
  // (RankPlanner); a smaller workspace needs every rank's use, so every
  // GPU's schedule rows are built and summed (WorkspaceUse), failing on
  // every rank when some rank needs more, before the rank's own program.
  // traffic: row-major int32 or int64 [G * G], G = num_servers * M.
  template <typename Count>
  PlanStatus BuildRank(const Count* traffic, int num_servers,
                       int gpus_per_server, int64_t rows_in, int64_t rows_out,
                       int64_t ws_rows, int rank, RankProgram* out) {
    if (num_servers < 1 || gpus_per_server < 1) {
      return {PlanFailure::kTraffic,
              "num_servers and gpus_per_server must be >= 1"};
    }
    const int64_t g = static_cast<int64_t>(num_servers) * gpus_per_server;
    traffic_.assign(traffic, traffic + g * g);
    return BuildRankOwned(num_servers, gpus_per_server, rows_in, rows_out,
                          ws_rows, rank, out);
  }

  // The whole plan (every rank's ops): checks the traffic against the
  // buffer sizes, schedules and plans.
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
  PlanStatus BuildRankOwned(int num_servers, int gpus_per_server,
                            int64_t rows_in, int64_t rows_out, int64_t ws_rows,
                            int rank, RankProgram* out);
  PlanStatus CheckWorkspaceUse(int num_servers, int gpus_per_server,
                               int64_t ws_rows);
  std::vector<int64_t> traffic_;
  FastScheduler scheduler_;
  FastSchedule schedule_;
  ExecutionPlanner planner_;
  ExecutionPlan plan_;
  RankPlanner rank_planner_;
  std::vector<int64_t> use_;  // every GPU's workspace rows (CheckWorkspaceUse)
};

}  // namespace moe_jax::fast

#endif  // MOE_JAX_XLA_FFI_FAST_PLAN_H_

// FAST all-to-all(v) scheduler (Lei et al., NSDI '26), plain C++17.
//
// Same algorithm and tie-breaking as moe_jax/fast/reference.py, which
// documents it: intra-server balancing (unit u of server pair (a, b) is
// carried by local GPU (u + a + b) % M), greedy padding of the server matrix
// to equal row/column sums, integer Birkhoff-von Neumann decomposition with
// augmenting paths that keeps the previous stage's matching and only
// re-augments rows whose matched entry reached zero, per-stage scale-out
// (peer GPU l -> l) and redistribution, and the intra-server part.  Each
// re-augmentation is a breadth-first search (shortest augmenting path).
//
// Implementation (same results, less work):
// * Decomposition subtracts stage weights lazily: a matched row keeps
//   key = residual + weight subtracted so far, so a stage is a minimum over
//   n contiguous keys, and only the rows it zeroes are touched.  Real units
//   equal the weight except on padded entries, which alone are tracked.
//   Below 65 servers the augmenting search keeps its reached columns in
//   one word.
// * Lane queues are flat: every lane's pieces lie back to back in one pool.
// * With gpu >= 0 only the server pairs of gpu's server are balanced, and
//   only the two of them in each stage (the inverse matching is kept per
//   stage) are expanded.  Their balancing builds gpu's lane queue alone:
//   the givers' tails form one stream that the receivers split in lane
//   order, so gpu's segment of it, its own tail's receivers and the other
//   lanes' units for gpu follow from excess and deficit sums.  The other
//   lanes of a pair into gpu's server keep only the unit ranges of their
//   flows to gpu (targets), which their peers forward to gpu.
// * Rows are written through raw pointers after one capacity check per
//   server pair.
//
// A FastScheduler keeps its buffers between calls: scheduling matrices of
// the same size again does not allocate.
#ifndef MOE_JAX_XLA_FFI_FAST_SCHEDULER_H_
#define MOE_JAX_XLA_FFI_FAST_SCHEDULER_H_

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <vector>

namespace moe_jax::fast {

// Growable int64 array without value-initialisation (rows are written
// through Append's pointer); keeps its capacity across clear().
class RowBuffer {
 public:
  int64_t* data() { return data_.get(); }
  const int64_t* data() const { return data_.get(); }
  size_t size() const { return size_; }
  void clear() { size_ = 0; }
  // Pointer to k new, uninitialised slots at the end.
  int64_t* Append(size_t k) {
    if (size_ + k > capacity_) Grow(size_ + k);
    int64_t* p = data_.get() + size_;
    size_ += k;
    return p;
  }
  // Pointer to the end, with room for at least k more slots; write through
  // it, then Commit the pointer past the last slot written.
  int64_t* Reserve(size_t k) {
    if (size_ + k > capacity_) Grow(size_ + k);
    return data_.get() + size_;
  }
  void Commit(const int64_t* end) {
    size_ = static_cast<size_t>(end - data_.get());
  }
  // Hands the storage to the caller (freed with std::free).
  int64_t* Release() {
    capacity_ = size_ = 0;
    return data_.release();
  }

 private:
  struct Free {
    void operator()(int64_t* p) const { std::free(p); }
  };
  void Grow(size_t need) {
    size_t cap = capacity_ < 4096 ? 4096 : capacity_;
    while (cap < need) cap *= 2;
    void* p = std::realloc(data_.get(), cap * sizeof(int64_t));
    if (p == nullptr) throw std::bad_alloc();
    data_.release();
    data_.reset(static_cast<int64_t*>(p));
    capacity_ = cap;
  }
  std::unique_ptr<int64_t, Free> data_;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

// Columns of FastSchedule::transfers (row-major, kTransferCols per row).
// stage: 0 balance, 1 intra, 2 + 2k scale-out of BvN stage k,
// 3 + 2k redistribution of BvN stage k.
enum TransferCol : int {
  kStage = 0, kSrc, kDst, kAmount, kFlowSrc, kFlowDst, kTransferCols
};

// A full schedule comes in two forms.  Rows (FastScheduler::Schedule):
// every transfer of every GPU as one row of `transfers` /
// `redistribution`.  Ranges (FastScheduler::ScheduleRanges): the same
// schedule with each stage's transfers as unit ranges of the lane queues,
// which every row follows from without a search:
// * lane l of pair (a, b) carries the units u < D[a, b] with
//   (u + a + b) % M == l; its queue is GPU a*M+l's own row of the tile
//   (columns l, l + 1, .. mod M, zero entries skipped), its first
//   min(have, want) units (have: lane_units, want: its share of the
//   units), then, on a receiving lane, the balancing rows into it in row
//   order (each one piece of the given flow);
// * BvN stage k sends units [pair_sent[k, a], + real[k, a]) of pair
//   (a, matchings[k, a]), so lane l sends its queue units
//   [c(pair_sent), c(pair_sent + real)) with c(x) = (x + M - 1 - r) / M,
//   r = (l - a - b) mod M: one scale-out row per queue piece the range
//   overlaps (src a*M+l, dst b*M+l) and one redistribution row (dst b*M+l
//   to the flow's destination) per such piece not for b*M+l;
// * the intra-server part is every flow within a server, sent directly.
// ExpandRows turns the ranges into the rows (same rows, same order).
struct FastSchedule {
  int num_servers = 0;
  int gpus_per_server = 0;
  int64_t bound = 0;                 // max row/col sum of the server matrix
  int num_stages = 0;                // BvN stages S
  std::vector<int64_t> server;       // [n * n] server matrix D
  std::vector<int64_t> padded;       // [n * n] D + padding
  std::vector<int64_t> matchings;    // [S * n] destination server of a
  std::vector<int64_t> weights;      // [S]
  std::vector<int64_t> real;         // [S * n] real units a sends in stage k
  std::vector<int64_t> lane_units;   // [G * n] units GPU s has for server b
  // Ranges form (and rows form of a full schedule): [S * n] units of pair
  // (a, matchings[k, a]) sent before stage k; [n * n + 1] first balancing
  // row of pair (a, b) (pairs in row-major order).
  std::vector<int64_t> pair_sent;
  std::vector<int64_t> balance_begin;
  // Whether transfers / redistribution hold every row (else the balancing
  // rows alone: the ranges form).
  bool rows = false;
  // [K * kTransferCols]: balance, intra and scale-out rows, by stage.
  RowBuffer transfers;
  // [R * kTransferCols]: redistribution rows (stage 3 + 2k), by stage.
  RowBuffer redistribution;
};

class FastScheduler {
 public:
  // traffic: row-major int64[G * G], G = num_servers * gpus_per_server,
  // non-negative.  With with_transfers=false only the server-level part
  // (server matrix, padding, decomposition, real per-stage units) is built.
  // gpu >= 0: keep only the transfers GPU `gpu` sends or receives (what
  // one rank needs to execute its part; the server-level arrays are the
  // same), expanding only its server's tiles.
  // Returns an empty string on success, else an error message.
  std::string Schedule(const int64_t* traffic, int num_servers,
                       int gpus_per_server, bool with_transfers,
                       FastSchedule* out, int64_t gpu = -1);
  // The full schedule in the ranges form (see FastSchedule): the
  // server-level part, the balancing rows, lane_units, pair_sent and
  // balance_begin.
  std::string ScheduleRanges(const int64_t* traffic, int num_servers,
                             int gpus_per_server, FastSchedule* out);
  // Ranges form -> rows form (appends the intra-server, scale-out and
  // redistribution rows); traffic: the matrix it was built from.
  void ExpandRows(const int64_t* traffic, FastSchedule* out);

 private:
  // Server matrix, padding, decomposition and stage order of `traffic`;
  // empties the transfer lists. gpu: -1 or the GPU a per-GPU schedule is for.
  std::string ServerLevel(const int64_t* traffic, int num_servers, int gpus_per_server,
                          int64_t gpu, FastSchedule* out);
  struct Piece {
    int32_t flow_src;
    int32_t flow_dst;
    int64_t amount;
  };
  // Units [begin, end) of a lane's queue that belong to the flow from
  // flow_src to gpu_ (per-GPU schedules).
  struct Target {
    int64_t begin;
    int64_t end;
    int32_t flow_src;
  };
  // Units per lane of one pair in one BvN stage.
  struct StageShare {
    int64_t q;
    int rem;
    int first_lane;
    int64_t Units(int lane, int m) const;
  };
  int64_t ServerMatrix(const int64_t* traffic, FastSchedule* out);
  void Pad(FastSchedule* out);
  bool Augment(int u, int64_t cum);
  bool AugmentOneWord(int u, int64_t cum);
  void FlipPath(int u, int v, int64_t cum);
  void Rematch(int row, int col, int64_t cum);
  bool Decompose(FastSchedule* out);
  void OrderStages(FastSchedule* out);
  void EmitStageRows(int k, FastSchedule* out);
  void BuildTransfers(const int64_t* traffic, FastSchedule* out);
  void BalanceRanges(const int64_t* traffic, int a, int b, int64_t big,
                     RowBuffer* rows);
  template <int M>
  void BalanceRangesM(const int64_t* traffic, int a, int b, int64_t big,
                      RowBuffer* rows);
  void PairSent(FastSchedule* out);
  template <int M>
  void LaneShares(int a, int b, int64_t big);
  void BalancePairForGpu(const int64_t* traffic, int a, int b, int64_t big,
                         RowBuffer* rows);
  // The tile of a pair being balanced (rows `g` apart).
  struct StreamPair {
    const int64_t* tile0;
    int64_t g;
    int a;
    int b;
  };
  Piece* ReceiveSegment(const StreamPair& p, bool with_rows, int64_t** w,
                        Piece* at);
  int64_t* GiveTail(const StreamPair& p, int64_t* w);
  void StreamTargets(const StreamPair& p);
  Piece* PutKeptPieces(const int64_t* tile, int lane, int32_t flow_src, int32_t dst0,
                       int64_t keep, Piece* at);
  void FirstTargets(const int64_t* tile0, int a);
  void BuildIntra(const int64_t* traffic, RowBuffer* rows);
  StageShare TakeShare(int a, int b, int64_t x);
  template <bool kRedistribute>
  void WalkLane(size_t lane, int64_t c, int k, int64_t src, int64_t dst,
                int64_t*& w, int64_t*& r);
  void ScaleOutPair(int k, int a, int b, int64_t x, int64_t** tr,
                    int64_t** red);
  void ScaleOutIntoGpu(int k, int a, int64_t x, int64_t** tr, int64_t** red);

  int n_ = 0;
  int m_ = 0;
  int64_t gpu_ = -1;
  const int64_t* units_ = nullptr;  // the schedule's lane_units
  // Decomposition: unmatched entries' residuals, matched rows' keys.
  std::vector<int64_t> residual_;   // [n * n]
  std::vector<int64_t> key_;        // [n] residual of the matched entry + cum
  std::vector<int64_t> real_left_;  // [n * n] real units left (padded entries)
  std::vector<uint8_t> on_padding_;  // [n] matched entry has padding
  std::vector<int> match_row_, match_col_, prev_, queue_, freed_;
  std::vector<int64_t> order_size_, scratch_match_, scratch_w_;
  std::vector<int> order_;
  // The second stage runs in parts of cumulative weight kSplitCum[i] /
  // kSplitCum[2] (10 : 13 : 17), so each part's balancing overlaps the
  // previous part's scale-out.
  static constexpr int64_t kSplitCum[3] = {10, 23, 40};
  struct Part {
    int stage;
    int64_t weight;
  };
  std::vector<Part> parts_;
  std::vector<int32_t> scratch_inv_;
  std::vector<int32_t> inverse_;    // [S * n] server sending to b in stage k
  int words_ = 0;                   // 64-bit words per bitset row
  std::vector<uint64_t> support_;   // [n * words_] residual > 0
  std::vector<uint64_t> seen_;      // [words_] columns reached
  // Lane queues: lane (a, b, l) is pool_[qbeg_[lane] ..), the lanes of a
  // pair back to back; pool_ only grows (pool_used_ pieces in use).
  std::vector<Piece> pool_;
  int64_t pool_used_ = 0;
  std::vector<int64_t> qbeg_;       // [n * n * M] head of each lane
  std::vector<int64_t> pair_size_;  // [n * n] pieces of the pair's lanes
  // Per-GPU schedules, lane (a, l) of pair (a, gpu_'s server): its targets
  // at targets_[(a * M + l) * M ..] (target_count_ of them), the next one
  // to forward and the units the lane has sent.
  std::vector<Target> targets_;
  std::vector<int> target_count_, target_next_;
  std::vector<int64_t> target_done_;
  std::vector<int64_t> have_, want_, rowacc_;
  std::vector<int64_t> before_;     // [M] units of a row before gpu_'s column
  std::vector<int64_t> remaining_, sent_;
  // Balancing in the ranges form: givers, the receivers' cumulative
  // deficits and lanes, the givers' stream pieces (cumulative ends, giver
  // lane << 32 | column).
  std::vector<int> lanes_;                         // [M]
  std::vector<int64_t> take_end_, take_dst_;       // [M + 1], [M]
  std::vector<int64_t> piece_end_, piece_tag_;     // [M * M + 1], [M * M]
};

// Workspace rows each GPU's plan uses (plan.h's ExecutionPlan::
// workspace_used: the balancing rows it receives and the scale-out rows it
// receives for another GPU), from a full schedule in either form and the
// traffic it was built from, without its rows (not for per-GPU schedules).
void WorkspaceUseOfRanges(const int64_t* traffic, const FastSchedule& schedule,
                          std::vector<int64_t>* use);

// SpreadOut time of a square int64[N * N] matrix: sum over shifts
// i = 1..N-1 of max_s x[s, (s + i) % N].
int64_t SpreadOutTime(const int64_t* x, int n);

}  // namespace moe_jax::fast

#endif  // MOE_JAX_XLA_FFI_FAST_SCHEDULER_H_

// Count-aware NVLink dispatch/combine: the host-side view of a channel and
// the four kernel launchers (plain C++, no device code).
//
// A channel is the persistent state one expert-parallel group of GPUs shares
// for one (tokens, top_k, experts_per_rank, row_bytes, dispatch format)
// signature: on every rank one device allocation holding
//
//   counters  u64[4 * P + 9]: dispatch arrivals / acks, combine arrivals /
//             acks (one per peer), then 4 call epochs and 5 block tallies
//             (the four calls and the plan). An arrival counter grows by
//             kSignalUnit per call, however many blocks signal it; an ack
//             holds how many of the calls it covers the peer has finished
//             receiving.
//   headers   i32[2][P][P * E_local]: each source's send counts, per parity
//   index     i32[2][P][W]: for each source, the token row (in its dispatch
//             staging) of every entry of its stream to this rank
//   dispatch  [2][P][T][D]: token rows each source sent, at the token's
//             index, once per token and destination rank however many of
//             its picks live there
//   combine   [2][P][W][row_bytes]: expert outputs each expert rank returned,
//             one per (token, pick)
//   local     i32[chunks][P * E_local] where each plan chunk's entries
//             start in each stream, then (fp8 dispatch) the quantized tokens
//             [T][D]; never read by peers
//
// with W = T * min(k, E_local), the most (token, pick) entries one source
// can send one rank, and D the bytes of a dispatched row (row_bytes, or
// H + 4 * H / 128 for e4m3 with per-128 float32 scales). A stream to a rank
// lists its entries by (local expert, token, pick); the index maps each
// entry to its token, whose row the receiver copies into the grouped layout.
// Senders store rows straight into the receiver's buffers over NVLink (peer
// access), then raise the receiver's arrival counter; receivers wait on it
// on the device. Buffers alternate between two parities by call count, and
// a sender only reuses a parity once every receiver acknowledged reading it
// (receivers acknowledge at the start of their next send on the channel),
// so at most two sends per channel may be outstanding. Counts never leave
// the device and nothing synchronizes with the host: every launcher enqueues
// kernels only (command-buffer compatible).
#ifndef MOE_JAX_CUDA_NVLINK_CHANNEL_H_
#define MOE_JAX_CUDA_NVLINK_CHANNEL_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "pack_combine.h"

#ifdef __CUDACC__
#define MOE_JAX_HD __host__ __device__
#else
#define MOE_JAX_HD
#endif

namespace moe_jax::cuda::nvlink {

inline constexpr int kMaxRanks = 8;
inline constexpr int kMaxExperts = 1024;        // P * E_local
inline constexpr int kMaxLocalExperts = 256;    // E_local
inline constexpr int kPlanChunkTokens = 128;    // tokens one plan block orders
// What one call adds to each arrival counter it raises (more than any grid).
inline constexpr unsigned long long kSignalUnit = 1ull << 20;

// Counter slots (u64) at the start of every rank's block.
struct Counters {
  MOE_JAX_HD static int64_t DispatchArrive(int p, int src) { return src; }
  MOE_JAX_HD static int64_t DispatchAck(int p, int dst) { return p + dst; }
  MOE_JAX_HD static int64_t CombineArrive(int p, int src) { return 2 * p + src; }
  MOE_JAX_HD static int64_t CombineAck(int p, int dst) { return 3 * p + dst; }
  MOE_JAX_HD static int64_t Epoch(int p, int call) { return 4 * p + call; }   // call 0..3
  MOE_JAX_HD static int64_t Tally(int p, int call) { return 4 * p + 4 + call; }  // call 0..4
  MOE_JAX_HD static int64_t Count(int p) { return 4 * p + 9; }
};

enum Call : int {
  kDispatchSend = 0, kDispatchRecv = 1, kCombineSend = 2, kCombineRecv = 3,
  kPlan = 4,  // a tally only: the plan has no epoch and signals no peer
};

struct ChannelShape {
  int32_t num_ranks = 0;         // P
  int32_t experts_per_rank = 0;  // E_local
  int64_t tokens = 0;            // T
  int32_t top_k = 0;             // k
  int64_t row_bytes = 0;         // H * itemsize of x and y, a multiple of 16
  int32_t dispatch_fp8 = 0;      // 1: x is bf16, dispatched as e4m3 + f32 scales

  MOE_JAX_HD static int64_t Align(int64_t bytes) { return (bytes + 255) / 256 * 256; }
  MOE_JAX_HD int64_t Slots() const { return tokens * top_k; }
  MOE_JAX_HD int64_t RowsPerSource() const {  // W
    return tokens * (top_k < experts_per_rank ? top_k : experts_per_rank);
  }
  MOE_JAX_HD int64_t NumExperts() const { return int64_t{num_ranks} * experts_per_rank; }
  // fp8 dispatch: H e4m3 bytes, then H / 128 float32 scales (x is bf16).
  MOE_JAX_HD int64_t Hidden() const { return row_bytes / 2; }
  MOE_JAX_HD int64_t DispatchRowBytes() const {  // D
    return dispatch_fp8 ? Hidden() + Hidden() / 32 : row_bytes;
  }
  // Bytes of a dispatched row's first part (rows result); the rest (scales) follows.
  MOE_JAX_HD int64_t DispatchValueBytes() const { return dispatch_fp8 ? Hidden() : row_bytes; }

  MOE_JAX_HD int64_t CountersBytes() const { return Counters::Count(num_ranks) * 8; }
  MOE_JAX_HD int64_t HeadersOffset() const { return CountersBytes(); }
  MOE_JAX_HD int64_t HeaderInts() const { return NumExperts(); }  // one source's [P, E_local]
  MOE_JAX_HD int64_t HeadersBytes() const { return 2 * num_ranks * HeaderInts() * 4; }
  MOE_JAX_HD int64_t IndexOffset() const { return HeadersOffset() + HeadersBytes(); }
  MOE_JAX_HD int64_t IndexBytes() const { return 2 * num_ranks * RowsPerSource() * 4; }
  MOE_JAX_HD int64_t DispatchOffset() const { return Align(IndexOffset() + IndexBytes()); }
  MOE_JAX_HD int64_t DispatchStagingBytes() const {
    return 2 * num_ranks * tokens * DispatchRowBytes();
  }
  MOE_JAX_HD int64_t CombineOffset() const { return DispatchOffset() + DispatchStagingBytes(); }
  MOE_JAX_HD int64_t CombineStagingBytes() const {
    return 2 * num_ranks * RowsPerSource() * row_bytes;
  }
  MOE_JAX_HD int64_t PlanChunks() const {
    return (tokens + kPlanChunkTokens - 1) / kPlanChunkTokens;
  }
  MOE_JAX_HD int64_t ChunkEntryStartOffset() const {
    return Align(CombineOffset() + CombineStagingBytes());
  }
  MOE_JAX_HD int64_t QuantizedOffset() const {
    return Align(ChunkEntryStartOffset() + PlanChunks() * NumExperts() * 4);
  }
  MOE_JAX_HD int64_t TotalBytes() const {
    return QuantizedOffset() + (dispatch_fp8 ? tokens * DispatchRowBytes() : 0);
  }
};

// What one rank's kernels see: every rank's block (peer pointers) and its
// own rank. Passed by value.
struct ChannelView {
  ChannelShape shape;
  int32_t rank = 0;
  uint8_t* base[kMaxRanks] = {};
};

// Blocks each kernel launches: a function of the shape only.
int SendBlocks(const ChannelShape& s);
int RecvBlocks(const ChannelShape& s);
int CombineSendBlocks(const ChannelShape& s);
int CombineRecvBlocks(const ChannelShape& s);

// Once per device (current device) before the first launch for this shape.
cudaError_t ConfigureKernels(const ChannelShape& s);

// Whether LaunchDispatch / LaunchCombine run as one kernel for this shape on
// the current device (small calls: every block of the grid fits on the GPU
// at once, and the plan fits one block).
bool FusedDispatch(const ChannelShape& s);
bool FusedCombine(const ChannelShape& s);

// dispatch send: positions of this rank's (token, pick) slots in their
// streams, send counts, then each token's row once into the buffer of every
// rank that one of its picks lives on (quantized first for fp8 dispatch).
//   x [T, row_bytes]; expert_ids [T * k] i32 (out of range: dropped)
//   slot_pos [T * k] i32 out (-1 for dropped picks); send_counts [P * E_local] i32 out
cudaError_t LaunchDispatchSend(const ChannelView& ch, const void* x,
                               const int32_t* expert_ids, int32_t* slot_pos,
                               int32_t* send_counts, cudaStream_t stream);

// dispatch recv: waits for every source, then copies one row per (token,
// pick) into `rows` [P * W, DispatchValueBytes()] grouped by local expert,
// within an expert by (source, token, pick); for fp8 dispatch the scales go
// to `scales` [P * W, H / 128] f32 (nullptr otherwise). Rows past the
// received total are left as they were.
//   group_sizes [E_local] i32 out; all_counts [P, P, E_local] i32 out
cudaError_t LaunchDispatchRecv(const ChannelView& ch, void* rows, float* scales,
                               int32_t* group_sizes, int32_t* all_counts,
                               cudaStream_t stream);

// dispatch send then dispatch recv, as one kernel when FusedDispatch(s)
// (plus the quantization kernel for fp8 dispatch).
cudaError_t LaunchDispatch(const ChannelView& ch, const void* x,
                           const int32_t* expert_ids, int32_t* slot_pos,
                           int32_t* send_counts, void* rows, float* scales,
                           int32_t* group_sizes, int32_t* all_counts, cudaStream_t stream);

// combine send: expert outputs y [P * W, row_bytes] (the layout dispatch
// recv produced) back to their sources. all_counts from dispatch recv.
cudaError_t LaunchCombineSend(const ChannelView& ch, const void* y,
                              const int32_t* all_counts, cudaStream_t stream);

// combine recv: out[t] = sum_j weights[t, j] * returned row of (t, j), float32
// accumulation in pick order (multiply and add rounded separately), stored
// as `type`. slot_pos and expert_ids as dispatch send saw them.
cudaError_t LaunchCombineRecv(const ChannelView& ch, ElemType type,
                              const int32_t* expert_ids, const int32_t* slot_pos,
                              const float* weights, void* out, cudaStream_t stream);

// combine send then combine recv, as one kernel when FusedCombine(s).
cudaError_t LaunchCombine(const ChannelView& ch, ElemType type, const void* y,
                          const int32_t* all_counts, const int32_t* expert_ids,
                          const int32_t* slot_pos, const float* weights, void* out,
                          cudaStream_t stream);

}  // namespace moe_jax::cuda::nvlink

#endif  // MOE_JAX_CUDA_NVLINK_CHANNEL_H_

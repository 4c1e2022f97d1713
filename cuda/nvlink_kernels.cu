// Kernels of the count-aware NVLink channel (nvlink_channel.h).
//
// Synchronization: every block of a sender stores its share of the rows
// into the peers' buffers and raises each peer's arrival counter for this
// rank with a release reduction (after a block barrier); the blocks' adds
// sum to kSignalUnit per call (block 0 adds kSignalUnit - blocks + 1, the
// others 1), so the counter reaches (call index + 1) * kSignalUnit exactly
// when every block has signalled, whatever the grid. A receiver's threads
// wait on every peer's counter in parallel (acquire loads), and the block
// barrier orders the row reads after the waits; rows are read with
// L2-coherent loads. Receivers acknowledge lazily: every kernel that sends
// (dispatch send, combine send, the fused kernels) first publishes, with a
// relaxed max on each peer's ack slot for this rank, how many dispatch and
// combine receives this rank has finished (all earlier kernels on the
// stream are done), then waits for its peers' acks before reusing a parity
// two calls later. Call indices (epochs) live on the device: each block
// reads them at its start and counts itself on a tally, and the last block
// to count advances them, so graph replays need no host-side state.
//
// Dispatch moves each token once per destination rank (however many of its
// picks live there), at its token index in that rank's staging, and an
// index entry per (token, pick); the receiver expands the index into one row
// per pick while it groups the rows by expert, a copy it makes anyway.
#include "nvlink_channel.h"

#include <algorithm>
#include <cstdio>

#include <cuda_fp8.h>

#include "vec_access.cuh"

namespace moe_jax::cuda::nvlink {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCopyBlocks = 528;
// Calls of at most this many tokens run dispatch and combine as one kernel
// each (when the shared memory allows), every block planning the whole call.
constexpr int64_t kFusedMaxTokens = 256;
constexpr unsigned long long kTimeoutNs = 30ull * 1000 * 1000 * 1000;

using u64 = unsigned long long;

__device__ __forceinline__ u64* CountersOf(const ChannelView& ch, int rank) {
  return reinterpret_cast<u64*>(ch.base[rank]);
}

__device__ __forceinline__ u64 LoadAcquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ u64 GlobalTimer() {
  u64 t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Spins until *p >= target; traps (a CUDA error the caller sees) after
// kTimeoutNs, naming what it waited for, rather than hanging forever.
__device__ void WaitAtLeast(const u64* p, u64 target, const char* what, int rank, int peer) {
  if (LoadAcquire(p) >= target) return;
  const u64 start = GlobalTimer();
  while (LoadAcquire(p) < target) {
    __nanosleep(64);
    if (GlobalTimer() - start > kTimeoutNs) {
      printf("moe_jax nvlink channel: rank %d timed out waiting for %s of rank %d "
             "(have %llu, want %llu); did every rank run the same calls?\n",
             rank, what, peer, LoadAcquire(p), target);
      __trap();
    }
  }
}

// Threads 0..P-1 each wait until this rank's counter slot0 + peer reaches
// `target`; the barrier then orders the whole block after the waits.
__device__ void WaitForPeers(const ChannelView& ch, int64_t slot0, u64 target,
                             const char* what) {
  const int peer = threadIdx.x;
  if (peer < ch.shape.num_ranks) {
    WaitAtLeast(CountersOf(ch, ch.rank) + slot0 + peer, target, what, ch.rank, peer);
  }
  __syncthreads();
}

__device__ __forceinline__ void SignalAdd(u64* counter, u64 amount) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" :: "l"(counter), "l"(amount)
               : "memory");
}

__device__ __forceinline__ void SignalMax(u64* counter, u64 value) {
  asm volatile("red.relaxed.sys.global.max.u64 [%0], %1;" :: "l"(counter), "l"(value)
               : "memory");
}

__device__ __forceinline__ u64 LoadVolatile(const u64* p) {
  return *reinterpret_cast<const volatile u64*>(p);
}

// The epochs (call indices) of the call(s) a kernel runs: fused kernels run
// a send and its receive.
struct CallState {
  u64 first = 0;
  u64 second = 0;
};

// Publishes (the grid's last block, thread i to rank i) how many dispatch
// and combine receives this rank has finished on the channel: every kernel
// before this one on the stream is done, so their reads of the staging are
// too. Kernels that send call it before they wait for any ack, so a rank's
// acks never wait on its peers' (two sends may precede their receives).
__device__ __forceinline__ void Acknowledge(const ChannelView& ch) {
  const int p = ch.shape.num_ranks;
  if (blockIdx.x != gridDim.x - 1 || threadIdx.x >= p) return;
  const u64* mine = CountersOf(ch, ch.rank);
  const u64 dispatches = LoadVolatile(mine + Counters::Epoch(p, kDispatchRecv));
  const u64 combines = LoadVolatile(mine + Counters::Epoch(p, kCombineRecv));
  u64* peer = CountersOf(ch, threadIdx.x);
  SignalMax(peer + Counters::DispatchAck(p, ch.rank), dispatches);
  SignalMax(peer + Counters::CombineAck(p, ch.rank), combines);
}

// Every block calls this first: thread 0 reads the epochs of `call` and
// (second >= 0) `second` for the block. A kernel that sends into a parity
// (reuse_slot0 >= 0) also acknowledges, then waits, thread i for rank i,
// until every receiver acknowledged the call two before (the ack slots
// start at reuse_slot0).
__device__ __forceinline__ CallState CallStart(const ChannelView& ch, int call, int second,
                                               int64_t reuse_slot0 = -1,
                                               const char* what = nullptr) {
  __shared__ CallState state;
  const int p = ch.shape.num_ranks;
  const u64* mine = CountersOf(ch, ch.rank);
  if (threadIdx.x == 0) {
    state.first = LoadVolatile(mine + Counters::Epoch(p, call));
    state.second = second >= 0 ? LoadVolatile(mine + Counters::Epoch(p, second)) : 0;
  }
  if (reuse_slot0 >= 0) {
    Acknowledge(ch);
    if (threadIdx.x < p) {
      const u64 epoch = LoadVolatile(mine + Counters::Epoch(p, call));
      if (epoch >= 2) {
        WaitAtLeast(mine + reuse_slot0 + threadIdx.x, epoch - 1, what, ch.rank, threadIdx.x);
      }
    }
  }
  __syncthreads();
  return state;
}

// Every block calls this once, after CallStart and before anything that
// could wait long (its latency then hides): thread 0 counts the block on
// the call's tally, and the last block of the grid to count (every block
// has read the epochs) advances them for the next call on this stream.
__device__ __forceinline__ void CountCall(const ChannelView& ch, int call, int second,
                                          const CallState& read) {
  if (threadIdx.x != 0) return;
  const int p = ch.shape.num_ranks;
  u64* mine = CountersOf(ch, ch.rank);
  u64* tally = mine + Counters::Tally(p, call);
  u64 before;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(before) : "l"(tally)
               : "memory");
  if (before != gridDim.x - 1) return;
  *tally = 0;
  mine[Counters::Epoch(p, call)] = read.first + 1;
  if (second >= 0) mine[Counters::Epoch(p, second)] = read.second + 1;
}

// After its stores to the peers: every block raises each peer's counter
// slot0 + (this rank) by its part of kSignalUnit (thread i signals rank i).
__device__ __forceinline__ void SignalArrival(const ChannelView& ch, int64_t slot0) {
  __syncthreads();
  if (threadIdx.x < ch.shape.num_ranks) {
    const u64 part = blockIdx.x == 0 ? kSignalUnit - gridDim.x + 1 : 1;
    SignalAdd(CountersOf(ch, threadIdx.x) + slot0 + ch.rank, part);
  }
}

// Waits until every source's arrival counter (from slot0) covers call `epoch`.
__device__ __forceinline__ void WaitArrivals(const ChannelView& ch, int64_t slot0, u64 epoch,
                                             const char* what) {
  WaitForPeers(ch, slot0, (epoch + 1) * kSignalUnit, what);
}

// Every block of the plan calls this after its stores; returns (to every
// thread) whether this block is the last of the grid to do so. The last
// block then sees every block's stores and has reset the tally.
__device__ __forceinline__ bool LastPlanBlock(const ChannelView& ch) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    u64* tally = CountersOf(ch, ch.rank) + Counters::Tally(ch.shape.num_ranks, kPlan);
    __threadfence();
    last = atomicAdd(tally, 1ull) == gridDim.x - 1;
    if (last) {
      __threadfence();
      atomicExch(tally, 0ull);
    }
  }
  __syncthreads();
  return last;
}

__device__ __forceinline__ int32_t* Header(const ChannelView& ch, int rank, int parity,
                                           int src) {
  const ChannelShape& s = ch.shape;
  return reinterpret_cast<int32_t*>(ch.base[rank] + s.HeadersOffset()) +
         (int64_t{parity} * s.num_ranks + src) * s.HeaderInts();
}

__device__ __forceinline__ int32_t* IndexOf(const ChannelView& ch, int rank, int parity,
                                            int src) {
  const ChannelShape& s = ch.shape;
  return reinterpret_cast<int32_t*>(ch.base[rank] + s.IndexOffset()) +
         (int64_t{parity} * s.num_ranks + src) * s.RowsPerSource();
}

__device__ __forceinline__ uint8_t* DispatchRow(const ChannelView& ch, int rank, int parity,
                                                int src, int64_t row) {
  const ChannelShape& s = ch.shape;
  return ch.base[rank] + s.DispatchOffset() +
         ((int64_t{parity} * s.num_ranks + src) * s.tokens + row) * s.DispatchRowBytes();
}

__device__ __forceinline__ uint8_t* CombineRow(const ChannelView& ch, int rank, int parity,
                                               int src, int64_t pos) {
  const ChannelShape& s = ch.shape;
  return ch.base[rank] + s.CombineOffset() +
         ((int64_t{parity} * s.num_ranks + src) * s.RowsPerSource() + pos) * s.row_bytes;
}

// Whether one of token t's picks lives on rank d.
__device__ __forceinline__ bool PicksOn(const ChannelShape& s, const int32_t* expert_ids,
                                        int64_t t, int d) {
  const int64_t num_experts = s.NumExperts();
  for (int j = 0; j < s.top_k; ++j) {
    const int32_t e = expert_ids[t * s.top_k + j];
    if (e >= 0 && e < num_experts && e / s.experts_per_rank == d) return true;
  }
  return false;
}

// Per-block tables of the rows this rank holds for each (source, local
// expert): counts, where each source's stream starts the expert, where the
// expert's rows start in the grouped layout, and where the source's rows
// start inside the expert.
struct RecvTables {
  int32_t count[kMaxRanks][kMaxLocalExperts];
  int32_t stream_start[kMaxRanks][kMaxLocalExperts];
  int32_t src_offset[kMaxRanks][kMaxLocalExperts];
  int32_t expert_offset[kMaxLocalExperts + 1];
  // Combine send: where each rank's rows start when the ranks are taken in
  // the order rank + 1, rank + 2, ... (this rank last).
  int32_t rotated_start[kMaxRanks + 1];
};

// Fills everything from `count` (already loaded); returns nothing, total in
// expert_offset[E_local]. All threads of the block take part.
__device__ void BuildTables(RecvTables& tb, int num_ranks, int num_local) {
  __syncthreads();
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    int32_t run = 0;
    for (int s = 0; s < num_ranks; ++s) {
      tb.src_offset[s][e] = run;
      run += tb.count[s][e];
    }
    tb.expert_offset[e] = run;  // the expert's total for now
  }
  for (int s = threadIdx.x; s < num_ranks; s += blockDim.x) {
    int32_t run = 0;
    for (int e = 0; e < num_local; ++e) {
      tb.stream_start[s][e] = run;
      run += tb.count[s][e];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (int e = 0; e < num_local; ++e) {
      const int32_t total = tb.expert_offset[e];
      tb.expert_offset[e] = run;
      run += total;
    }
    tb.expert_offset[num_local] = run;
  }
  __syncthreads();
}

// Fills tb.rotated_start (after BuildTables) for the ranks in the order
// rank + 1, rank + 2, ..., rank: every sender starts with a different receiver.
__device__ void BuildRotation(RecvTables& tb, int num_ranks, int num_local, int rank) {
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (int i = 0; i < num_ranks; ++i) {
      const int to = (rank + 1 + i) % num_ranks;
      tb.rotated_start[i] = run;
      run += tb.stream_start[to][num_local - 1] + tb.count[to][num_local - 1];
    }
    tb.rotated_start[num_ranks] = run;
  }
  __syncthreads();
}

// Unit u of the rotated order -> (rank, position in its stream, grouped row).
__device__ __forceinline__ int32_t LocateRotated(const RecvTables& tb, int num_ranks,
                                                 int num_local, int rank, int32_t u, int& to,
                                                 int32_t& pos) {
  int i = 0;
  while (i + 1 < num_ranks && tb.rotated_start[i + 1] <= u) ++i;
  to = (rank + 1 + i) % num_ranks;
  pos = u - tb.rotated_start[i];
  int lo = 0, hi = num_local;  // last e with stream_start[to][e] <= pos
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (tb.stream_start[to][mid] <= pos) lo = mid; else hi = mid;
  }
  return tb.expert_offset[lo] + tb.src_offset[to][lo] + (pos - tb.stream_start[to][lo]);
}

// Grouped row r -> (source, position in that source's stream).
__device__ __forceinline__ void Locate(const RecvTables& tb, int num_ranks, int num_local,
                                       int32_t r, int& src, int32_t& pos) {
  int lo = 0, hi = num_local;  // last e with expert_offset[e] <= r
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (tb.expert_offset[mid] <= r) lo = mid; else hi = mid;
  }
  const int e = lo;
  const int32_t j = r - tb.expert_offset[e];
  int s = 0;
  while (s + 1 < num_ranks && tb.src_offset[s + 1][e] <= j) ++s;
  src = s;
  pos = tb.stream_start[s][e] + (j - tb.src_offset[s][e]);
}

// Copies num_rows rows of `vecs` 16-byte vectors, one warp per (row, chunk
// of kChunkVecs vectors), grid-stride. where(r, &src, &dst, &tail) names row
// r's source (nullptr: skip the row) and destination; vectors from `split`
// on go to tail[v - split] instead of dst[v]. Each lane loads kUnroll
// vectors before storing any, keeping several transfers in flight. Loads are
// L2-coherent (sources may be buffers peers wrote).
constexpr int kUnroll = 4;
constexpr int kChunkVecs = 32 * kUnroll;

__host__ __device__ constexpr int32_t ChunksPerRow(int64_t row_bytes) {
  return static_cast<int32_t>((row_bytes / 16 + kChunkVecs - 1) / kChunkVecs);
}

template <typename Where>
__device__ __forceinline__ void CopyRows(int32_t num_rows, int32_t vecs, int32_t split,
                                         Where where) {
  const int32_t chunks = (vecs + kChunkVecs - 1) / kChunkVecs;
  const int32_t units = num_rows * chunks;
  const int32_t warps = static_cast<int32_t>(gridDim.x) * kWarps;
  const int lane = threadIdx.x % 32;
  for (int32_t u = static_cast<int32_t>(blockIdx.x) * kWarps + threadIdx.x / 32; u < units;
       u += warps) {
    const int32_t r = u / chunks;
    const int32_t first = (u % chunks) * kChunkVecs + lane;
    const uint4* src = nullptr;
    uint4* dst = nullptr;
    uint4* tail = nullptr;
    where(r, &src, &dst, &tail);
    if (src == nullptr) continue;
    uint4 val[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int32_t v = first + k * 32;
      if (v < vecs) val[k] = __ldcg(src + v);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int32_t v = first + k * 32;
      if (v < vecs) {
        if (v < split) dst[v] = val[k]; else tail[v - split] = val[k];
      }
    }
  }
}

//===----------------------------------------------------------------------===//
// the plan: where every (token, pick) entry and token row goes
//===----------------------------------------------------------------------===//

__device__ __forceinline__ int32_t* ChunkEntryStart(const ChannelView& ch) {  // [chunks][E]
  return reinterpret_cast<int32_t*>(ch.base[ch.rank] + ch.shape.ChunkEntryStartOffset());
}

// Slots each thread orders per round of PlanChunk.
constexpr int kPlanSub = 4;

// Shared memory one block needs to order a chunk: per-warp and running
// per-expert counts.
struct PlanScratch {
  int32_t* warp_count;  // [kWarps][E]
  int32_t* count;       // [E]
};

__host__ __device__ constexpr int64_t PlanSmemInts(int64_t num_experts) {
  return (kWarps + 1) * num_experts;
}

// Points ps at its arrays in dynamic shared memory `smem` (PlanSmemInts
// ints); returns the first int after them.
__device__ __forceinline__ int32_t* AttachPlanScratch(PlanScratch& ps, int32_t* smem,
                                                      int num_experts) {
  ps.warp_count = smem;
  ps.count = smem + kWarps * num_experts;
  return ps.count + num_experts;
}

// Orders the tokens [t0, t1) of one chunk, all threads of the block taking
// part: entry_rank[n - t0 * k] is the rank of slot n among the chunk's slots
// of its expert, in (token, pick) order, or -1 for a dropped pick. Leaves
// the chunk's per-expert counts in ps.count.
__device__ void PlanChunk(const ChannelShape& s, const int32_t* __restrict__ expert_ids,
                          int64_t t0, int64_t t1, int32_t* entry_rank, PlanScratch& ps) {
  const int num_experts = static_cast<int>(s.NumExperts());
  const int k = s.top_k;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned below = (1u << lane) - 1;
  int32_t* warp_count = ps.warp_count + warp * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) ps.count[e] = 0;
  const int64_t n0 = t0 * k, n1 = t1 * k;
  // A round orders up to kThreads * kPlanSub slots: warp w takes `sub` runs
  // of 32 consecutive slots (sub as small as keeps every warp busy),
  // counting each expert's slots on its own row of warp_count as it goes;
  // one prefix over the warps then places them.
  int64_t sub = 0;
  for (int64_t c0 = n0; c0 < n1; c0 += kThreads * sub) {
    sub = (n1 - c0 + kThreads - 1) / kThreads;
    if (sub > kPlanSub) sub = kPlanSub;
    for (int i = threadIdx.x; i < kWarps * num_experts; i += blockDim.x) ps.warp_count[i] = 0;
    __syncthreads();
    int32_t expert[kPlanSub];
    int32_t rank_in_warp[kPlanSub];
#pragma unroll
    for (int j = 0; j < kPlanSub; ++j) {
      expert[j] = -1;
      if (j >= sub) break;
      const int64_t n = c0 + (warp * sub + j) * 32 + lane;
      const int32_t e = n < n1 ? expert_ids[n] : -1;
      const bool valid = e >= 0 && e < num_experts;
      const unsigned same = __match_any_sync(0xffffffffu, valid ? e : -1);
      const int lane_rank = __popc(same & below);
      const int32_t earlier = valid ? warp_count[e] : 0;
      __syncwarp();
      if (valid && lane_rank == 0) warp_count[e] = earlier + __popc(same);
      __syncwarp();
      expert[j] = valid ? e : -1;
      rank_in_warp[j] = earlier + lane_rank;
    }
    __syncthreads();
    for (int ex = threadIdx.x; ex < num_experts; ex += blockDim.x) {
      int32_t run = ps.count[ex];
      for (int w = 0; w < kWarps; ++w) {
        const int32_t c = ps.warp_count[w * num_experts + ex];
        ps.warp_count[w * num_experts + ex] = run;
        run += c;
      }
      ps.count[ex] = run;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kPlanSub; ++j) {
      if (j >= sub) break;
      const int64_t n = c0 + (warp * sub + j) * 32 + lane;
      if (n >= n1) continue;
      entry_rank[n - n0] = expert[j] >= 0 ? warp_count[expert[j]] + rank_in_warp[j] : -1;
    }
    __syncthreads();
  }
}

// offset[e] = entries of the lower local experts of e's rank, from totals
// count[E] (shared memory); all threads take part.
__device__ void StreamOffsets(int num_experts, int num_local, const int32_t* count,
                              int32_t* offset) {
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t run = 0;
    for (int q = e - e % num_local; q < e; ++q) run += count[q];
    offset[e] = run;
  }
  __syncthreads();
}

// Exclusive scan over chunks of every column of the row-major [chunks][cols]
// table, in place, a thread per column (loads issued kBatch at a time); the
// column totals go to total[cols]. All threads of the block take part.
__device__ void ScanColumns(int32_t* table, int64_t chunks, int cols, int32_t* total) {
  constexpr int kBatch = 8;
  for (int col = threadIdx.x; col < cols; col += blockDim.x) {
    int32_t run = 0;
    for (int64_t c0 = 0; c0 < chunks; c0 += kBatch) {
      int32_t v[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        v[b] = c0 + b < chunks ? __ldcg(table + (c0 + b) * cols + col) : 0;
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (c0 + b < chunks) table[(c0 + b) * cols + col] = run;
        run += v[b];
      }
    }
    total[col] = run;
  }
}

// One block per chunk of kPlanChunkTokens tokens: slot_pos[n] holds ranks
// within the chunk; the last block then turns the chunks' counts into where
// each chunk's entries start in each stream (ChunkEntryStart, by expert) and
// writes send_counts.
__global__ void __launch_bounds__(kThreads)
PlanKernel(ChannelView ch, const int32_t* __restrict__ expert_ids,
           int32_t* __restrict__ slot_pos, int32_t* __restrict__ send_counts) {
  extern __shared__ int32_t smem[];
  __shared__ PlanScratch ps;
  const ChannelShape& s = ch.shape;
  const int num_experts = static_cast<int>(s.NumExperts());
  AttachPlanScratch(ps, smem, num_experts);
  const int64_t chunk = blockIdx.x, chunks = gridDim.x;
  const int64_t t0 = chunk * kPlanChunkTokens;
  const int64_t t1 = t0 + kPlanChunkTokens < s.tokens ? t0 + kPlanChunkTokens : s.tokens;
  PlanChunk(s, expert_ids, t0, t1, slot_pos + t0 * s.top_k, ps);
  int32_t* entry_start = ChunkEntryStart(ch);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    entry_start[chunk * num_experts + e] = ps.count[e];
  }
  if (!LastPlanBlock(ch)) return;
  ScanColumns(entry_start, chunks, num_experts, ps.count);
  int32_t* offset = ps.warp_count;
  StreamOffsets(num_experts, s.experts_per_rank, ps.count, offset);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) send_counts[e] = ps.count[e];
  for (int64_t i = threadIdx.x; i < chunks * num_experts; i += blockDim.x) {
    entry_start[i] += offset[i % num_experts];
  }
}

//===----------------------------------------------------------------------===//
// dispatch send
//===----------------------------------------------------------------------===//

// fp8 dispatch: each token row -> H e4m3 values then H / 128 float32
// scales, one warp per 128-element block with amax = max |x|:
// value = e4m3(x * (448 / amax)) (round to nearest even, saturating) and
// scale = amax * f32(1 / 448), both 1 when the block is all zeros. IEEE division
// and multiply (no fast math), so references reproduce every bit.
__global__ void __launch_bounds__(kThreads)
QuantizeKernel(ChannelView ch, const uint16_t* __restrict__ x) {
  const ChannelShape& s = ch.shape;
  const int64_t hidden = s.Hidden();
  const int64_t blocks_per_row = hidden / 128;
  const int64_t units = s.tokens * blocks_per_row;
  uint8_t* quantized = ch.base[ch.rank] + s.QuantizedOffset();
  const int lane = threadIdx.x % 32;
  for (int64_t u = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; u < units;
       u += int64_t{gridDim.x} * kWarps) {
    const int64_t t = u / blocks_per_row, b = u % blocks_per_row;
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(x + t * hidden + b * 128) + lane);
    float v[4];
    v[0] = __uint_as_float((raw.x & 0xffffu) << 16);
    v[1] = __uint_as_float(raw.x & 0xffff0000u);
    v[2] = __uint_as_float((raw.y & 0xffffu) << 16);
    v[3] = __uint_as_float(raw.y & 0xffff0000u);
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float inverse = amax > 0.0f ? __fdiv_rn(448.0f, amax) : 1.0f;
    const float scale = amax > 0.0f ? __fmul_rn(amax, 1.0f / 448.0f) : 1.0f;
    uint32_t packed = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const __nv_fp8_storage_t f8 =
          __nv_cvt_float_to_fp8(__fmul_rn(v[q], inverse), __NV_SATFINITE, __NV_E4M3);
      packed |= uint32_t{f8} << (8 * q);
    }
    uint8_t* row = quantized + t * s.DispatchRowBytes();
    reinterpret_cast<uint32_t*>(row + b * 128)[lane] = packed;
    if (lane == 0) reinterpret_cast<float*>(row + hidden)[b] = scale;
  }
}

// Dispatch send, in the order the fused kernel runs it: each token row
// once to every rank one of its picks lives on, at its token index.
__device__ __forceinline__ void SendRows(const ChannelView& ch, int parity,
                                         const uint8_t* __restrict__ rows,
                                         const int32_t* __restrict__ expert_ids) {
  const ChannelShape& s = ch.shape;
  const int p = s.num_ranks;
  const int64_t row_bytes = s.DispatchRowBytes();
  const int32_t vecs = static_cast<int32_t>(row_bytes / 16);
  CopyRows(static_cast<int32_t>(s.tokens * p), vecs, vecs,
           [&](int32_t r, const uint4** src, uint4** dst, uint4** /*tail*/) {
             const int64_t t = r / p;
             const int d = r % p;
             if (!PicksOn(s, expert_ids, t, d)) return;
             *src = reinterpret_cast<const uint4*>(rows + t * row_bytes);
             *dst = reinterpret_cast<uint4*>(DispatchRow(ch, d, parity, ch.rank, t));
           });
}

// The stream entries (position(n) -> stream position of slot n, or -1):
// each names its token in the destination's index list; block d (mod the
// grid) also writes this rank's send counts into rank d's header.
template <typename Position>
__device__ __forceinline__ void SendIndex(const ChannelView& ch, int parity,
                                          const int32_t* __restrict__ expert_ids,
                                          const int32_t* send_counts, Position position) {
  const ChannelShape& s = ch.shape;
  for (int d = 0; d < s.num_ranks; ++d) {
    if (d % static_cast<int>(gridDim.x) != static_cast<int>(blockIdx.x)) continue;
    int32_t* h = Header(ch, d, parity, ch.rank);
    for (int64_t i = threadIdx.x; i < s.HeaderInts(); i += blockDim.x) h[i] = send_counts[i];
  }
  for (int64_t n = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; n < s.Slots();
       n += int64_t{gridDim.x} * blockDim.x) {
    const int32_t pos = position(n);
    if (pos < 0) continue;
    const int d = expert_ids[n] / s.experts_per_rank;
    IndexOf(ch, d, parity, ch.rank)[pos] = static_cast<int32_t>(n / s.top_k);
  }
}

// rows: x, or the quantized tokens for fp8 dispatch ([T, D] either way).
// Finishes slot_pos (chunk ranks -> stream positions) as it goes.
__global__ void __launch_bounds__(kThreads)
SendKernel(ChannelView ch, const uint8_t* __restrict__ rows,
           const int32_t* __restrict__ expert_ids, int32_t* __restrict__ slot_pos,
           const int32_t* __restrict__ send_counts) {
  const ChannelShape& s = ch.shape;
  const int num_experts = static_cast<int>(s.NumExperts());
  const int p = s.num_ranks;
  const int32_t* entry_start = ChunkEntryStart(ch);
  const int64_t per_chunk = int64_t{kPlanChunkTokens} * s.top_k;
  const CallState call =
      CallStart(ch, kDispatchSend, -1, Counters::DispatchAck(p, 0), "the dispatch ack");
  const int parity = static_cast<int>(call.first & 1);
  SendRows(ch, parity, rows, expert_ids);
  SendIndex(ch, parity, expert_ids, send_counts, [&](int64_t n) {
    const int32_t rank = slot_pos[n];
    if (rank < 0) return int32_t{-1};
    const int32_t pos = entry_start[(n / per_chunk) * num_experts + expert_ids[n]] + rank;
    slot_pos[n] = pos;
    return pos;
  });
  SignalArrival(ch, Counters::DispatchArrive(p, 0));
  CountCall(ch, kDispatchSend, -1, call);
}

//===----------------------------------------------------------------------===//
// dispatch recv
//===----------------------------------------------------------------------===//

// The receive half of dispatch: waits for every source, then groups the
// received rows by expert.
__device__ void RecvHalf(const ChannelView& ch, u64 epoch, RecvTables& tb,
                         uint8_t* __restrict__ rows, uint8_t* __restrict__ scales,
                         int32_t* __restrict__ group_sizes, int32_t* __restrict__ all_counts) {
  const ChannelShape& s = ch.shape;
  const int p = s.num_ranks, num_local = s.experts_per_rank;
  const int parity = static_cast<int>(epoch & 1);
  WaitArrivals(ch, Counters::DispatchArrive(p, 0), epoch, "the dispatched rows");
  for (int i = threadIdx.x; i < p * num_local; i += blockDim.x) {
    const int src = i / num_local, e = i % num_local;
    tb.count[src][e] = __ldcg(Header(ch, ch.rank, parity, src) + ch.rank * num_local + e);
  }
  BuildTables(tb, p, num_local);
  const int64_t value_bytes = s.DispatchValueBytes();
  const int64_t scale_bytes = s.DispatchRowBytes() - value_bytes;
  CopyRows(tb.expert_offset[num_local], static_cast<int32_t>(s.DispatchRowBytes() / 16),
           static_cast<int32_t>(value_bytes / 16),
           [&](int32_t r, const uint4** src, uint4** dst, uint4** tail) {
             int from;
             int32_t pos;
             Locate(tb, p, num_local, r, from, pos);
             const int32_t token = __ldcg(IndexOf(ch, ch.rank, parity, from) + pos);
             *src = reinterpret_cast<const uint4*>(DispatchRow(ch, ch.rank, parity, from, token));
             *dst = reinterpret_cast<uint4*>(rows + int64_t{r} * value_bytes);
             *tail = reinterpret_cast<uint4*>(scales + int64_t{r} * scale_bytes);
           });
  if (blockIdx.x == gridDim.x - 1) {
    const int64_t ints = s.HeaderInts();
    for (int64_t i = threadIdx.x; i < p * ints; i += blockDim.x) {
      all_counts[i] = __ldcg(Header(ch, ch.rank, parity, static_cast<int>(i / ints)) + i % ints);
    }
    for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
      group_sizes[e] = tb.expert_offset[e + 1] - tb.expert_offset[e];
    }
  }
}

__global__ void __launch_bounds__(kThreads)
RecvKernel(ChannelView ch, uint8_t* __restrict__ rows, uint8_t* __restrict__ scales,
           int32_t* __restrict__ group_sizes, int32_t* __restrict__ all_counts) {
  __shared__ RecvTables tb;
  const CallState call = CallStart(ch, kDispatchRecv, -1);
  CountCall(ch, kDispatchRecv, -1, call);
  RecvHalf(ch, call.first, tb, rows, scales, group_sizes, all_counts);
}

// Plan, send and receive in one kernel for one-chunk calls whose grid fits
// on the GPU at once (so blocks waiting for the send cannot keep a sending
// block from running). Every block sends its share of the token rows first
// (they need no plan), then orders the call itself in shared memory.
__global__ void __launch_bounds__(kThreads)
FusedDispatchKernel(ChannelView ch, const uint8_t* __restrict__ send_rows,
                    const int32_t* __restrict__ expert_ids, int32_t* __restrict__ slot_pos,
                    int32_t* __restrict__ send_counts, uint8_t* __restrict__ rows,
                    uint8_t* __restrict__ scales, int32_t* __restrict__ group_sizes,
                    int32_t* __restrict__ all_counts) {
  extern __shared__ int32_t smem[];
  __shared__ PlanScratch ps;
  __shared__ RecvTables tb;
  const ChannelShape& s = ch.shape;
  const int num_experts = static_cast<int>(s.NumExperts());
  const int p = s.num_ranks;
  const CallState call = CallStart(ch, kDispatchSend, kDispatchRecv,
                                   Counters::DispatchAck(p, 0), "the dispatch ack");
  const int parity = static_cast<int>(call.first & 1);
  SendRows(ch, parity, send_rows, expert_ids);
  int32_t* entry_rank = AttachPlanScratch(ps, smem, num_experts);  // [T * k]
  PlanChunk(s, expert_ids, 0, s.tokens, entry_rank, ps);
  int32_t* offset = ps.warp_count;
  StreamOffsets(num_experts, s.experts_per_rank, ps.count, offset);
  auto position = [&](int64_t n) {
    return entry_rank[n] < 0 ? int32_t{-1} : entry_rank[n] + offset[expert_ids[n]];
  };
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) send_counts[e] = ps.count[e];
    for (int64_t n = threadIdx.x; n < s.Slots(); n += blockDim.x) slot_pos[n] = position(n);
  }
  SendIndex(ch, parity, expert_ids, ps.count, position);
  SignalArrival(ch, Counters::DispatchArrive(p, 0));
  CountCall(ch, kDispatchSend, kDispatchRecv, call);
  RecvHalf(ch, call.second, tb, rows, scales, group_sizes, all_counts);
}

//===----------------------------------------------------------------------===//
// combine send / recv
//===----------------------------------------------------------------------===//

__device__ void CombineSendHalf(const ChannelView& ch, const CallState& call, RecvTables& tb,
                                const uint8_t* __restrict__ y,
                                const int32_t* __restrict__ all_counts) {
  const ChannelShape& s = ch.shape;
  const int p = s.num_ranks, num_local = s.experts_per_rank;
  const u64 epoch = call.first;
  const int parity = static_cast<int>(epoch & 1);
  for (int i = threadIdx.x; i < p * num_local; i += blockDim.x) {
    const int src = i / num_local, e = i % num_local;
    tb.count[src][e] = all_counts[src * s.HeaderInts() + ch.rank * num_local + e];
  }
  BuildTables(tb, p, num_local);
  BuildRotation(tb, p, num_local, ch.rank);
  const int32_t vecs = static_cast<int32_t>(s.row_bytes / 16);
  CopyRows(tb.expert_offset[num_local], vecs, vecs,
           [&](int32_t u, const uint4** src, uint4** dst, uint4** /*tail*/) {
             int to;
             int32_t pos;
             const int32_t r = LocateRotated(tb, p, num_local, ch.rank, u, to, pos);
             *src = reinterpret_cast<const uint4*>(y + int64_t{r} * s.row_bytes);
             *dst = reinterpret_cast<uint4*>(CombineRow(ch, to, parity, ch.rank, pos));
           });
  SignalArrival(ch, Counters::CombineArrive(p, 0));
}

template <typename E>
__device__ void CombineRecvHalf(const ChannelView& ch, u64 epoch,
                                const int32_t* __restrict__ expert_ids,
                                const int32_t* __restrict__ slot_pos,
                                const float* __restrict__ weights,
                                typename E::Storage* __restrict__ out) {
  using S = typename E::Storage;
  constexpr int kPer = 16 / sizeof(S);
  constexpr int kBatch = 4;
  const ChannelShape& s = ch.shape;
  const int p = s.num_ranks;
  const int parity = static_cast<int>(epoch & 1);
  WaitArrivals(ch, Counters::CombineArrive(p, 0), epoch, "the returned rows");
  const int64_t vecs = s.row_bytes / 16;
  const int64_t total = s.tokens * vecs;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / vecs, v = i % vecs;
    float acc[kPer];
#pragma unroll
    for (int q = 0; q < kPer; ++q) acc[q] = 0.0f;
    // kBatch picks at a time: every row load is issued before the first add.
    for (int j0 = 0; j0 < s.top_k; j0 += kBatch) {
      union { uint4 vec; S elem[kPer]; } in[kBatch];
      float w[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t n = t * s.top_k + j0 + b;
        const int32_t pos = j0 + b < s.top_k ? slot_pos[n] : -1;
        w[b] = 0.0f;
        in[b].vec = make_uint4(0, 0, 0, 0);  // a dropped pick adds w * 0 = +0
        if (pos >= 0) {
          w[b] = weights[n];
          const int d = expert_ids[n] / s.experts_per_rank;
          in[b].vec =
              __ldcg(reinterpret_cast<const uint4*>(CombineRow(ch, ch.rank, parity, d, pos)) + v);
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (j0 + b >= s.top_k) break;
#pragma unroll
        for (int q = 0; q < kPer; ++q) {
          acc[q] = __fadd_rn(acc[q], __fmul_rn(w[b], E::ToFloat(in[b].elem[q])));
        }
      }
    }
    union { uint4 vec; S elem[kPer]; } o;
#pragma unroll
    for (int q = 0; q < kPer; ++q) o.elem[q] = E::FromFloat(acc[q]);
    reinterpret_cast<uint4*>(out + t * (s.row_bytes / sizeof(S)))[v] = o.vec;
  }
}

__global__ void __launch_bounds__(kThreads)
CombineSendKernel(ChannelView ch, const uint8_t* __restrict__ y,
                  const int32_t* __restrict__ all_counts) {
  __shared__ RecvTables tb;
  const CallState call =
      CallStart(ch, kCombineSend, -1, Counters::CombineAck(ch.shape.num_ranks, 0),
                "the combine ack");
  CombineSendHalf(ch, call, tb, y, all_counts);
  CountCall(ch, kCombineSend, -1, call);
}

template <typename E>
__global__ void __launch_bounds__(kThreads)
CombineRecvKernel(ChannelView ch, const int32_t* __restrict__ expert_ids,
                  const int32_t* __restrict__ slot_pos, const float* __restrict__ weights,
                  typename E::Storage* __restrict__ out) {
  const CallState call = CallStart(ch, kCombineRecv, -1);
  CountCall(ch, kCombineRecv, -1, call);
  CombineRecvHalf<E>(ch, call.first, expert_ids, slot_pos, weights, out);
}

// Combine send and receive in one kernel when the grid fits on the GPU at once.
template <typename E>
__global__ void __launch_bounds__(kThreads)
FusedCombineKernel(ChannelView ch, const uint8_t* __restrict__ y,
                   const int32_t* __restrict__ all_counts, const int32_t* __restrict__ expert_ids,
                   const int32_t* __restrict__ slot_pos, const float* __restrict__ weights,
                   typename E::Storage* __restrict__ out) {
  __shared__ RecvTables tb;
  const CallState call = CallStart(ch, kCombineSend, kCombineRecv,
                                   Counters::CombineAck(ch.shape.num_ranks, 0), "the combine ack");
  CombineSendHalf(ch, call, tb, y, all_counts);
  CountCall(ch, kCombineSend, kCombineRecv, call);
  CombineRecvHalf<E>(ch, call.second, expert_ids, slot_pos, weights, out);
}

int Blocks(int64_t units, int per_block) {
  const int64_t wanted = (units + per_block - 1) / per_block;
  return static_cast<int>(wanted < 1 ? 1 : (wanted > kMaxCopyBlocks ? kMaxCopyBlocks : wanted));
}

size_t PlanSmemBytes(const ChannelShape& s) {
  return static_cast<size_t>(PlanSmemInts(s.NumExperts())) * sizeof(int32_t);
}

size_t FusedDispatchSmemBytes(const ChannelShape& s) {
  return PlanSmemBytes(s) + static_cast<size_t>(s.Slots()) * 4;
}

// What the launch configuration depends on: the current device's SM count
// (blocks that surely run at once, one per SM) and the most shared memory a
// block may opt in to; 0 when unknown.
struct DeviceLimits {
  int sms = 0;
  int smem_optin = 0;
};

DeviceLimits CurrentDeviceLimits() {
  DeviceLimits lim;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&lim.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&lim.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                             device) != cudaSuccess) {
    return {};
  }
  return lim;
}

bool FusedDispatchOn(const ChannelShape& s, const DeviceLimits& lim) {
  return s.tokens <= kFusedMaxTokens && lim.sms > 0 &&
         static_cast<int64_t>(FusedDispatchSmemBytes(s)) +
                 static_cast<int64_t>(sizeof(RecvTables)) + 1024 <= lim.smem_optin;
}

bool FusedCombineOn(const ChannelShape& s, const DeviceLimits& lim) {
  return s.tokens <= kFusedMaxTokens && lim.sms > 0;
}

// A fused kernel's grid: what its halves want, at most one block per SM.
int FusedBlocks(int wanted, const DeviceLimits& lim) { return std::min(wanted, lim.sms); }

// The largest dynamic shared memory `kernel` may take on this device.
cudaError_t AllowDynamicSmem(const void* kernel, int optin, size_t needed) {
  cudaFuncAttributes attrs;
  if (cudaError_t err = cudaFuncGetAttributes(&attrs, kernel); err != cudaSuccess) return err;
  const int64_t available = optin - static_cast<int64_t>(attrs.sharedSizeBytes);
  if (static_cast<int64_t>(needed) > available) return cudaErrorInvalidValue;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(available));
}

}  // namespace

cudaError_t ConfigureKernels(const ChannelShape& s) {
  // The largest dynamic shared memory each kernel may take on this device,
  // so that channels of every shape keep working whichever was created last.
  const DeviceLimits lim = CurrentDeviceLimits();
  if (lim.smem_optin == 0) return cudaGetLastError();
  if (cudaError_t err = AllowDynamicSmem(reinterpret_cast<const void*>(PlanKernel),
                                         lim.smem_optin, PlanSmemBytes(s));
      err != cudaSuccess) {
    return err;
  }
  if (!FusedDispatchOn(s, lim)) return cudaSuccess;
  return AllowDynamicSmem(reinterpret_cast<const void*>(FusedDispatchKernel), lim.smem_optin,
                          FusedDispatchSmemBytes(s));
}

int SendBlocks(const ChannelShape& s) {
  return Blocks(s.tokens * s.num_ranks * ChunksPerRow(s.DispatchRowBytes()), kWarps);
}
int RecvBlocks(const ChannelShape& s) {
  return Blocks(s.num_ranks * s.RowsPerSource() * ChunksPerRow(s.DispatchRowBytes()), kWarps);
}
int CombineSendBlocks(const ChannelShape& s) {
  return Blocks(s.num_ranks * s.RowsPerSource() * ChunksPerRow(s.row_bytes), kWarps);
}
int CombineRecvBlocks(const ChannelShape& s) {
  return Blocks(s.tokens * (s.row_bytes / 16), kThreads);
}

bool FusedDispatch(const ChannelShape& s) { return FusedDispatchOn(s, CurrentDeviceLimits()); }

bool FusedCombine(const ChannelShape& s) { return FusedCombineOn(s, CurrentDeviceLimits()); }

namespace {

// x itself, or its e4m3 quantization (enqueued here) for fp8 dispatch.
const uint8_t* RowsToSend(const ChannelView& ch, const void* x, cudaStream_t stream) {
  const ChannelShape& s = ch.shape;
  if (!s.dispatch_fp8) return static_cast<const uint8_t*>(x);
  QuantizeKernel<<<Blocks(s.tokens * (s.Hidden() / 128), kWarps), kThreads, 0, stream>>>(
      ch, static_cast<const uint16_t*>(x));
  return ch.base[ch.rank] + s.QuantizedOffset();
}

// Calls f(E{}) with E the element type `type` names.
template <typename F>
void WithElemType(ElemType type, F f) {
  switch (type) {
    case ElemType::kF32: f(F32{}); break;
    case ElemType::kBF16: f(BF16{}); break;
    case ElemType::kF16: f(F16{}); break;
  }
}

}  // namespace

cudaError_t LaunchDispatchSend(const ChannelView& ch, const void* x, const int32_t* expert_ids,
                               int32_t* slot_pos, int32_t* send_counts, cudaStream_t stream) {
  const ChannelShape& s = ch.shape;
  PlanKernel<<<static_cast<int>(s.PlanChunks()), kThreads, PlanSmemBytes(s), stream>>>(
      ch, expert_ids, slot_pos, send_counts);
  const uint8_t* rows = RowsToSend(ch, x, stream);
  SendKernel<<<SendBlocks(s), kThreads, 0, stream>>>(ch, rows, expert_ids, slot_pos,
                                                     send_counts);
  return cudaGetLastError();
}

cudaError_t LaunchDispatchRecv(const ChannelView& ch, void* rows, float* scales,
                               int32_t* group_sizes, int32_t* all_counts,
                               cudaStream_t stream) {
  RecvKernel<<<RecvBlocks(ch.shape), kThreads, 0, stream>>>(
      ch, static_cast<uint8_t*>(rows), reinterpret_cast<uint8_t*>(scales), group_sizes,
      all_counts);
  return cudaGetLastError();
}

cudaError_t LaunchDispatch(const ChannelView& ch, const void* x, const int32_t* expert_ids,
                           int32_t* slot_pos, int32_t* send_counts, void* rows, float* scales,
                           int32_t* group_sizes, int32_t* all_counts, cudaStream_t stream) {
  const ChannelShape& s = ch.shape;
  const DeviceLimits lim = CurrentDeviceLimits();
  if (!FusedDispatchOn(s, lim)) {
    if (cudaError_t err = LaunchDispatchSend(ch, x, expert_ids, slot_pos, send_counts, stream);
        err != cudaSuccess) {
      return err;
    }
    return LaunchDispatchRecv(ch, rows, scales, group_sizes, all_counts, stream);
  }
  const uint8_t* send_rows = RowsToSend(ch, x, stream);
  const int blocks = FusedBlocks(std::max(SendBlocks(s), RecvBlocks(s)), lim);
  FusedDispatchKernel<<<blocks, kThreads, FusedDispatchSmemBytes(s), stream>>>(
      ch, send_rows, expert_ids, slot_pos, send_counts, static_cast<uint8_t*>(rows),
      reinterpret_cast<uint8_t*>(scales), group_sizes, all_counts);
  return cudaGetLastError();
}

cudaError_t LaunchCombineSend(const ChannelView& ch, const void* y, const int32_t* all_counts,
                              cudaStream_t stream) {
  CombineSendKernel<<<CombineSendBlocks(ch.shape), kThreads, 0, stream>>>(
      ch, static_cast<const uint8_t*>(y), all_counts);
  return cudaGetLastError();
}

cudaError_t LaunchCombineRecv(const ChannelView& ch, ElemType type, const int32_t* expert_ids,
                              const int32_t* slot_pos, const float* weights, void* out,
                              cudaStream_t stream) {
  WithElemType(type, [&](auto elem) {
    using E = decltype(elem);
    CombineRecvKernel<E><<<CombineRecvBlocks(ch.shape), kThreads, 0, stream>>>(
        ch, expert_ids, slot_pos, weights, static_cast<typename E::Storage*>(out));
  });
  return cudaGetLastError();
}

cudaError_t LaunchCombine(const ChannelView& ch, ElemType type, const void* y,
                          const int32_t* all_counts, const int32_t* expert_ids,
                          const int32_t* slot_pos, const float* weights, void* out,
                          cudaStream_t stream) {
  const ChannelShape& s = ch.shape;
  const DeviceLimits lim = CurrentDeviceLimits();
  if (!FusedCombineOn(s, lim)) {
    if (cudaError_t err = LaunchCombineSend(ch, y, all_counts, stream); err != cudaSuccess) {
      return err;
    }
    return LaunchCombineRecv(ch, type, expert_ids, slot_pos, weights, out, stream);
  }
  const int blocks = FusedBlocks(std::max(CombineSendBlocks(s), CombineRecvBlocks(s)), lim);
  WithElemType(type, [&](auto elem) {
    using E = decltype(elem);
    FusedCombineKernel<E><<<blocks, kThreads, 0, stream>>>(
        ch, static_cast<const uint8_t*>(y), all_counts, expert_ids, slot_pos, weights,
        static_cast<typename E::Storage*>(out));
  });
  return cudaGetLastError();
}

}  // namespace moe_jax::cuda::nvlink

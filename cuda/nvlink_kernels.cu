// Kernels of the count-aware NVLink channel (nvlink_channel.h).
//
// Synchronization: every block of a sender stores its rows into the peer's
// buffer, fences at system scope and counts itself done on a local tally;
// the last block to finish then adds 1 to each peer's arrival counter for
// this rank (one signal per call, however many blocks). A receiver's
// thread 0 waits (acquire loads) until the counter reaches the call index
// + 1, and the block barrier orders the row reads after it; rows are read
// with L2-coherent loads. After reading, the receiver acknowledges the same
// way, and the sender waits for that ack before reusing the parity two
// calls later. Call indices (epochs) live on the device: the last block of a
// call also advances its epoch, so graph replays need no host-side state.
//
// Dispatch moves each token once per destination rank (however many of its
// picks live there) and an index entry per (token, pick); the receiver
// expands the index into one row per pick while it groups the rows by
// expert, a copy it makes anyway.
#include "nvlink_channel.h"

#include <cstdio>

#include <cuda_fp8.h>

#include "vec_access.cuh"

namespace moe_jax::cuda::nvlink {
namespace {

constexpr int kThreads = 256;
constexpr int kPlanThreads = 1024;
constexpr int kMaxCopyBlocks = 528;
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

// Thread 0 waits until this rank's counters slot0 + peer reach `target` for
// every peer; the barrier then orders the whole block after the waits.
__device__ void WaitForPeers(const ChannelView& ch, int64_t slot0, u64 target,
                             const char* what) {
  if (threadIdx.x == 0) {
    for (int peer = 0; peer < ch.shape.num_ranks; ++peer) {
      WaitAtLeast(CountersOf(ch, ch.rank) + slot0 + peer, target, what, ch.rank, peer);
    }
  }
  __syncthreads();
}

// Reads this call's epoch (thread 0) into shared memory for the block.
__device__ __forceinline__ u64 BlockEpoch(const ChannelView& ch, int call) {
  __shared__ u64 epoch;
  if (threadIdx.x == 0) {
    epoch = *reinterpret_cast<volatile u64*>(CountersOf(ch, ch.rank) +
                                             Counters::Epoch(ch.shape.num_ranks, call));
  }
  __syncthreads();
  return epoch;
}

// Every block calls this last. The last block of the call to finish, once
// every block's stores are visible system-wide, adds 1 to counter
// signal_slot0 + (this rank) on every rank, then advances the call's epoch
// for the next call on this stream.
__device__ __forceinline__ void FinishCall(const ChannelView& ch, int call,
                                           int64_t signal_slot0) {
  __syncthreads();
  if (threadIdx.x == 0) {
    u64* c = CountersOf(ch, ch.rank);
    const int p = ch.shape.num_ranks;
    __threadfence_system();
    const u64 done = atomicAdd(c + Counters::Tally(p, call), 1ull);
    if (done == gridDim.x - 1) {
      __threadfence_system();
      atomicExch(c + Counters::Tally(p, call), 0ull);
      for (int peer = 0; peer < p; ++peer) {
        atomicAdd_system(CountersOf(ch, peer) + signal_slot0 + ch.rank, 1ull);
      }
      atomicAdd(c + Counters::Epoch(p, call), 1ull);
    }
  }
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

// This rank's i32[T][P] token rows of its current send (local scratch).
__device__ __forceinline__ int32_t* TokenRows(const ChannelView& ch) {
  return reinterpret_cast<int32_t*>(ch.base[ch.rank] + ch.shape.TokenRowsOffset());
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
constexpr int kWarps = kThreads / 32;
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
// dispatch send
//===----------------------------------------------------------------------===//

// One block: slot_pos[n] = position of slot n in its (this rank -> dest)
// stream, ordered by (local expert, token, pick); send_counts per expert;
// token_rows[t * P + d] = row of token t in the dispatch staging of rank d
// (tokens in order), -1 when no pick of t lives on d.
__global__ void PlanKernel(ChannelView ch, const int32_t* __restrict__ expert_ids,
                           int32_t* __restrict__ slot_pos, int32_t* __restrict__ send_counts) {
  extern __shared__ int32_t smem[];
  __shared__ int32_t warp_tokens[32][kMaxRanks];
  __shared__ int32_t token_base[kMaxRanks];
  const int num_experts = static_cast<int>(ch.shape.NumExperts());
  const int num_local = ch.shape.experts_per_rank;
  const int p = ch.shape.num_ranks, k = ch.shape.top_k;
  const int64_t n_slots = ch.shape.Slots();
  int32_t* warp_count = smem;                       // [32][E]
  int32_t* base = smem + 32 * num_experts;          // [E]
  int32_t* offset = base + num_experts;             // [E]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) base[e] = 0;
  for (int64_t c0 = 0; c0 < n_slots; c0 += blockDim.x) {
    for (int i = threadIdx.x; i < 32 * num_experts; i += blockDim.x) warp_count[i] = 0;
    __syncthreads();
    const int64_t n = c0 + threadIdx.x;
    const int32_t e = n < n_slots ? expert_ids[n] : -1;
    const bool valid = e >= 0 && e < num_experts;
    const unsigned same = __match_any_sync(0xffffffffu, valid ? e : -1);
    const int lane_rank = __popc(same & ((1u << lane) - 1));
    if (valid && lane_rank == 0) warp_count[warp * num_experts + e] = __popc(same);
    __syncthreads();
    for (int ex = threadIdx.x; ex < num_experts; ex += blockDim.x) {
      int32_t run = base[ex];
      for (int w = 0; w < 32; ++w) {
        const int32_t c = warp_count[w * num_experts + ex];
        warp_count[w * num_experts + ex] = run;
        run += c;
      }
      base[ex] = run;
    }
    __syncthreads();
    if (n < n_slots) slot_pos[n] = valid ? warp_count[warp * num_experts + e] + lane_rank : -1;
    __syncthreads();
  }
  for (int ex = threadIdx.x; ex < num_experts; ex += blockDim.x) {
    const int first = ex - ex % num_local;
    int32_t run = 0;
    for (int q = first; q < ex; ++q) run += base[q];
    offset[ex] = run;
    send_counts[ex] = base[ex];
  }
  __syncthreads();
  for (int64_t n = threadIdx.x; n < n_slots; n += blockDim.x) {
    const int32_t e = expert_ids[n];
    if (e >= 0 && e < num_experts) slot_pos[n] += offset[e];
  }

  int32_t* token_rows = TokenRows(ch);
  if (threadIdx.x < p) token_base[threadIdx.x] = 0;
  const unsigned below = (1u << lane) - 1;
  for (int64_t t0 = 0; t0 < ch.shape.tokens; t0 += blockDim.x) {
    const int64_t t = t0 + threadIdx.x;
    unsigned ranks = 0;  // bit d: some pick of t lives on rank d
    if (t < ch.shape.tokens) {
      for (int j = 0; j < k; ++j) {
        const int32_t e = expert_ids[t * k + j];
        if (e >= 0 && e < num_experts) ranks |= 1u << (e / num_local);
      }
    }
    __syncthreads();
    for (int d = 0; d < p; ++d) {
      const unsigned have = __ballot_sync(0xffffffffu, (ranks >> d) & 1u);
      if (lane == 0) warp_tokens[warp][d] = __popc(have);
    }
    __syncthreads();
    if (threadIdx.x < p) {
      const int d = threadIdx.x;
      int32_t run = token_base[d];
      for (int w = 0; w < 32; ++w) {
        const int32_t c = warp_tokens[w][d];
        warp_tokens[w][d] = run;
        run += c;
      }
      token_base[d] = run;
    }
    __syncthreads();
    for (int d = 0; d < p; ++d) {
      const unsigned have = __ballot_sync(0xffffffffu, (ranks >> d) & 1u);
      if (t < ch.shape.tokens) {
        token_rows[t * p + d] =
            (ranks >> d) & 1u ? warp_tokens[warp][d] + __popc(have & below) : -1;
      }
    }
  }
}

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

// rows: x, or the quantized tokens for fp8 dispatch ([T, D] either way).
__global__ void __launch_bounds__(kThreads)
SendKernel(ChannelView ch, const uint8_t* __restrict__ rows,
           const int32_t* __restrict__ expert_ids, const int32_t* __restrict__ slot_pos,
           const int32_t* __restrict__ send_counts) {
  const ChannelShape& s = ch.shape;
  const int p = s.num_ranks;
  const u64 epoch = BlockEpoch(ch, kDispatchSend);
  const int parity = static_cast<int>(epoch & 1);
  if (epoch >= 2) WaitForPeers(ch, Counters::DispatchAck(p, 0),
                               epoch - 1, "the dispatch ack");
  if (blockIdx.x == 0) {
    const int64_t ints = s.HeaderInts();
    for (int d = 0; d < p; ++d) {
      int32_t* h = Header(ch, d, parity, ch.rank);
      for (int64_t i = threadIdx.x; i < ints; i += blockDim.x) h[i] = send_counts[i];
    }
  }
  const int32_t* token_rows = TokenRows(ch);
  for (int64_t n = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; n < s.Slots();
       n += int64_t{gridDim.x} * blockDim.x) {
    const int32_t pos = slot_pos[n];
    if (pos < 0) continue;
    const int d = expert_ids[n] / s.experts_per_rank;
    IndexOf(ch, d, parity, ch.rank)[pos] = token_rows[(n / s.top_k) * p + d];
  }
  const int64_t row_bytes = s.DispatchRowBytes();
  const int32_t vecs = static_cast<int32_t>(row_bytes / 16);
  CopyRows(static_cast<int32_t>(s.tokens * p), vecs, vecs,
           [&](int32_t r, const uint4** src, uint4** dst, uint4** /*tail*/) {
             const int32_t row = token_rows[r];
             if (row < 0) return;
             const int d = r % p;
             *src = reinterpret_cast<const uint4*>(rows + int64_t{r / p} * row_bytes);
             *dst = reinterpret_cast<uint4*>(DispatchRow(ch, d, parity, ch.rank, row));
           });
  FinishCall(ch, kDispatchSend, Counters::DispatchArrive(p, 0));
}

//===----------------------------------------------------------------------===//
// dispatch recv
//===----------------------------------------------------------------------===//

__global__ void __launch_bounds__(kThreads)
RecvKernel(ChannelView ch, uint8_t* __restrict__ rows, uint8_t* __restrict__ scales,
           int32_t* __restrict__ group_sizes, int32_t* __restrict__ all_counts) {
  __shared__ RecvTables tb;
  const ChannelShape& s = ch.shape;
  const int p = s.num_ranks, num_local = s.experts_per_rank;
  const u64 epoch = BlockEpoch(ch, kDispatchRecv);
  const int parity = static_cast<int>(epoch & 1);
  WaitForPeers(ch, Counters::DispatchArrive(p, 0),
               epoch + 1, "the dispatched rows");
  for (int i = threadIdx.x; i < p * num_local; i += blockDim.x) {
    const int src = i / num_local, e = i % num_local;
    tb.count[src][e] = __ldcg(Header(ch, ch.rank, parity, src) + ch.rank * num_local + e);
  }
  if (blockIdx.x == 0) {
    const int64_t ints = s.HeaderInts();
    for (int64_t i = threadIdx.x; i < p * ints; i += blockDim.x) {
      all_counts[i] = __ldcg(Header(ch, ch.rank, parity, static_cast<int>(i / ints)) + i % ints);
    }
  }
  BuildTables(tb, p, num_local);
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
      group_sizes[e] = tb.expert_offset[e + 1] - tb.expert_offset[e];
    }
  }
  const int64_t value_bytes = s.DispatchValueBytes();
  const int64_t scale_bytes = s.DispatchRowBytes() - value_bytes;
  CopyRows(tb.expert_offset[num_local], static_cast<int32_t>(s.DispatchRowBytes() / 16),
           static_cast<int32_t>(value_bytes / 16),
           [&](int32_t r, const uint4** src, uint4** dst, uint4** tail) {
             int from;
             int32_t pos;
             Locate(tb, p, num_local, r, from, pos);
             const int32_t row = __ldcg(IndexOf(ch, ch.rank, parity, from) + pos);
             *src = reinterpret_cast<const uint4*>(DispatchRow(ch, ch.rank, parity, from, row));
             *dst = reinterpret_cast<uint4*>(rows + int64_t{r} * value_bytes);
             *tail = reinterpret_cast<uint4*>(scales + int64_t{r} * scale_bytes);
           });
  FinishCall(ch, kDispatchRecv, Counters::DispatchAck(p, 0));
}

//===----------------------------------------------------------------------===//
// combine send / recv
//===----------------------------------------------------------------------===//

__global__ void __launch_bounds__(kThreads)
CombineSendKernel(ChannelView ch, const uint8_t* __restrict__ y,
                  const int32_t* __restrict__ all_counts) {
  __shared__ RecvTables tb;
  const ChannelShape& s = ch.shape;
  const int p = s.num_ranks, num_local = s.experts_per_rank;
  const u64 epoch = BlockEpoch(ch, kCombineSend);
  const int parity = static_cast<int>(epoch & 1);
  for (int i = threadIdx.x; i < p * num_local; i += blockDim.x) {
    const int src = i / num_local, e = i % num_local;
    tb.count[src][e] = all_counts[src * s.HeaderInts() + ch.rank * num_local + e];
  }
  BuildTables(tb, p, num_local);
  if (epoch >= 2) WaitForPeers(ch, Counters::CombineAck(p, 0),
                               epoch - 1, "the combine ack");
  const int32_t vecs = static_cast<int32_t>(s.row_bytes / 16);
  CopyRows(tb.expert_offset[num_local], vecs, vecs,
           [&](int32_t r, const uint4** src, uint4** dst, uint4** /*tail*/) {
             int to;
             int32_t pos;
             Locate(tb, p, num_local, r, to, pos);
             *src = reinterpret_cast<const uint4*>(y + int64_t{r} * s.row_bytes);
             *dst = reinterpret_cast<uint4*>(CombineRow(ch, to, parity, ch.rank, pos));
           });
  FinishCall(ch, kCombineSend, Counters::CombineArrive(p, 0));
}

template <typename E>
__global__ void __launch_bounds__(kThreads)
CombineRecvKernel(ChannelView ch, const int32_t* __restrict__ expert_ids,
                  const int32_t* __restrict__ slot_pos, const float* __restrict__ weights,
                  typename E::Storage* __restrict__ out) {
  using S = typename E::Storage;
  constexpr int kPer = 16 / sizeof(S);
  const ChannelShape& s = ch.shape;
  const int p = s.num_ranks;
  const u64 epoch = BlockEpoch(ch, kCombineRecv);
  const int parity = static_cast<int>(epoch & 1);
  WaitForPeers(ch, Counters::CombineArrive(p, 0),
               epoch + 1, "the returned rows");
  const int64_t vecs = s.row_bytes / 16;
  const int64_t total = s.tokens * vecs;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / vecs, v = i % vecs;
    float acc[kPer];
#pragma unroll
    for (int q = 0; q < kPer; ++q) acc[q] = 0.0f;
#pragma unroll 4
    for (int j = 0; j < s.top_k; ++j) {
      const int64_t n = t * s.top_k + j;
      const int32_t pos = slot_pos[n];
      if (pos < 0) {
#pragma unroll
        for (int q = 0; q < kPer; ++q) acc[q] = __fadd_rn(acc[q], 0.0f);
        continue;
      }
      const int d = expert_ids[n] / s.experts_per_rank;
      const float w = weights[n];
      union { uint4 vec; S elem[kPer]; } in;
      in.vec = __ldcg(reinterpret_cast<const uint4*>(CombineRow(ch, ch.rank, parity, d, pos)) + v);
#pragma unroll
      for (int q = 0; q < kPer; ++q) {
        acc[q] = __fadd_rn(acc[q], __fmul_rn(w, E::ToFloat(in.elem[q])));
      }
    }
    union { uint4 vec; S elem[kPer]; } o;
#pragma unroll
    for (int q = 0; q < kPer; ++q) o.elem[q] = E::FromFloat(acc[q]);
    reinterpret_cast<uint4*>(out + t * (s.row_bytes / sizeof(S)))[v] = o.vec;
  }
  FinishCall(ch, kCombineRecv, Counters::CombineAck(p, 0));
}

int Blocks(int64_t units, int per_block) {
  const int64_t wanted = (units + per_block - 1) / per_block;
  return static_cast<int>(wanted < 1 ? 1 : (wanted > kMaxCopyBlocks ? kMaxCopyBlocks : wanted));
}

size_t PlanSmemBytes(const ChannelShape& s) {
  return static_cast<size_t>(34 * s.NumExperts()) * sizeof(int32_t);
}

}  // namespace

cudaError_t ConfigureKernels(const ChannelShape& s) {
  // The largest dynamic shared memory the plan may take on this device, so
  // that channels of every shape keep working whichever was created last.
  int device = 0, optin = 0;
  cudaFuncAttributes attrs;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, PlanKernel);
  if (err != cudaSuccess) return err;
  const int64_t available = optin - static_cast<int64_t>(attrs.sharedSizeBytes);
  if (static_cast<int64_t>(PlanSmemBytes(s)) > available) return cudaErrorInvalidValue;
  return cudaFuncSetAttribute(PlanKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(available));
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

cudaError_t LaunchDispatchSend(const ChannelView& ch, const void* x, const int32_t* expert_ids,
                               int32_t* slot_pos, int32_t* send_counts, cudaStream_t stream) {
  const ChannelShape& s = ch.shape;
  PlanKernel<<<1, kPlanThreads, PlanSmemBytes(s), stream>>>(ch, expert_ids, slot_pos,
                                                            send_counts);
  const uint8_t* rows = static_cast<const uint8_t*>(x);
  if (s.dispatch_fp8) {
    QuantizeKernel<<<Blocks(s.tokens * (s.Hidden() / 128), kWarps), kThreads, 0, stream>>>(
        ch, static_cast<const uint16_t*>(x));
    rows = ch.base[ch.rank] + s.QuantizedOffset();
  }
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

cudaError_t LaunchCombineSend(const ChannelView& ch, const void* y, const int32_t* all_counts,
                              cudaStream_t stream) {
  CombineSendKernel<<<CombineSendBlocks(ch.shape), kThreads, 0, stream>>>(
      ch, static_cast<const uint8_t*>(y), all_counts);
  return cudaGetLastError();
}

cudaError_t LaunchCombineRecv(const ChannelView& ch, ElemType type, const int32_t* expert_ids,
                              const int32_t* slot_pos, const float* weights, void* out,
                              cudaStream_t stream) {
  const int blocks = CombineRecvBlocks(ch.shape);
  switch (type) {
    case ElemType::kF32:
      CombineRecvKernel<F32><<<blocks, kThreads, 0, stream>>>(
          ch, expert_ids, slot_pos, weights, static_cast<float*>(out));
      break;
    case ElemType::kBF16:
      CombineRecvKernel<BF16><<<blocks, kThreads, 0, stream>>>(
          ch, expert_ids, slot_pos, weights, static_cast<unsigned short*>(out));
      break;
    case ElemType::kF16:
      CombineRecvKernel<F16><<<blocks, kThreads, 0, stream>>>(
          ch, expert_ids, slot_pos, weights, static_cast<unsigned short*>(out));
      break;
  }
  return cudaGetLastError();
}

}  // namespace moe_jax::cuda::nvlink

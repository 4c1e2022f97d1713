// Kernels of the count-aware NVLink channel (nvlink_channel.h).
//
// Synchronization: a sender's blocks store rows into the peer's buffer,
// then each block fences at system scope and adds 1 to the peer's arrival
// counter for this rank. A receiver's thread 0 waits (acquire loads) until
// the counter reaches blocks * (call index + 1), and the block barrier
// orders the row reads after it; rows are read with L2-coherent loads.
// After reading, each receiver block adds 1 to the sender's ack counter,
// which the sender waits on before reusing that parity two calls later.
// Call indices (epochs) live on the device: the last block of a call
// advances its epoch, so graph replays need no host-side state.
#include "nvlink_channel.h"

#include <cstdio>

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

// Adds 1 to counter slot0 + (this rank) on every rank, after this block's
// stores (ordered by the barrier before it) are visible system-wide.
__device__ __forceinline__ void SignalPeers(const ChannelView& ch, int64_t slot0) {
  __threadfence_system();
  for (int peer = 0; peer < ch.shape.num_ranks; ++peer) {
    atomicAdd_system(CountersOf(ch, peer) + slot0 + ch.rank, 1ull);
  }
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

// Called by every block after its last use of the epoch: the last block to
// finish advances it for the next call on this stream.
__device__ __forceinline__ void FinishCall(const ChannelView& ch, int call) {
  __syncthreads();
  if (threadIdx.x == 0) {
    u64* c = CountersOf(ch, ch.rank);
    const int p = ch.shape.num_ranks;
    __threadfence();
    const u64 done = atomicAdd(c + Counters::Tally(p, call), 1ull);
    if (done == gridDim.x - 1) {
      atomicExch(c + Counters::Tally(p, call), 0ull);
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

__device__ __forceinline__ uint8_t* StagedRow(const ChannelView& ch, int rank, int64_t offset,
                                              int parity, int src, int64_t pos) {
  const ChannelShape& s = ch.shape;
  return ch.base[rank] + offset +
         ((int64_t{parity} * s.num_ranks + src) * s.RowsPerSource() + pos) * s.row_bytes;
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

// Grid-stride copy of `total` 16-byte vectors; where(i, &src, &dst) names
// vector i's source and destination (dst nullptr: skip). Each thread loads
// kUnroll vectors before storing any, keeping several transfers in flight.
// Loads are L2-coherent (sources may be buffers peers wrote).
constexpr int kUnroll = 4;

template <typename Where>
__device__ __forceinline__ void CopyVectors(int32_t total, Where where) {
  const int32_t stride = static_cast<int32_t>(gridDim.x * blockDim.x);
  for (int32_t base = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x); base < total;
       base += stride * kUnroll) {
    uint4 val[kUnroll];
    uint4* dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int32_t i = base + u * stride;
      dst[u] = nullptr;
      if (i < total) {
        const uint4* src = nullptr;
        where(i, &src, &dst[u]);
        if (dst[u] != nullptr) val[u] = __ldcg(src);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (dst[u] != nullptr) *dst[u] = val[u];
    }
  }
}

//===----------------------------------------------------------------------===//
// dispatch send
//===----------------------------------------------------------------------===//

// One block: slot_pos[n] = position of slot n in its (this rank -> dest)
// stream, ordered by (local expert, token, pick); send_counts per expert.
__global__ void PlanKernel(ChannelView ch, const int32_t* __restrict__ expert_ids,
                           int32_t* __restrict__ slot_pos, int32_t* __restrict__ send_counts) {
  extern __shared__ int32_t smem[];
  const int num_experts = static_cast<int>(ch.shape.NumExperts());
  const int num_local = ch.shape.experts_per_rank;
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
}

__global__ void __launch_bounds__(kThreads)
SendKernel(ChannelView ch, const uint8_t* __restrict__ x, const int32_t* __restrict__ expert_ids,
           const int32_t* __restrict__ slot_pos, const int32_t* __restrict__ send_counts,
           int recv_blocks) {
  const ChannelShape& s = ch.shape;
  const int p = s.num_ranks;
  const u64 epoch = BlockEpoch(ch, kDispatchSend);
  const int parity = static_cast<int>(epoch & 1);
  if (epoch >= 2) WaitForPeers(ch, Counters::DispatchAck(p, 0),
                               u64(recv_blocks) * (epoch - 1), "the dispatch ack");
  if (blockIdx.x == 0) {
    const int64_t ints = s.HeaderInts();
    for (int d = 0; d < p; ++d) {
      int32_t* h = Header(ch, d, parity, ch.rank);
      for (int64_t i = threadIdx.x; i < ints; i += blockDim.x) h[i] = send_counts[i];
    }
  }
  const int32_t vecs = static_cast<int32_t>(s.row_bytes / 16);
  const int64_t offset = s.DispatchOffset();
  CopyVectors(static_cast<int32_t>(s.Slots() * vecs),
              [&](int32_t i, const uint4** src, uint4** dst) {
                const int32_t n = i / vecs, v = i % vecs;
                const int32_t pos = slot_pos[n];
                if (pos < 0) return;
                const int d = expert_ids[n] / s.experts_per_rank;
                *src = reinterpret_cast<const uint4*>(x + int64_t{n / s.top_k} * s.row_bytes) + v;
                *dst = reinterpret_cast<uint4*>(StagedRow(ch, d, offset, parity, ch.rank, pos)) + v;
              });
  __syncthreads();
  if (threadIdx.x == 0) SignalPeers(ch, Counters::DispatchArrive(p, 0));
  FinishCall(ch, kDispatchSend);
}

//===----------------------------------------------------------------------===//
// dispatch recv
//===----------------------------------------------------------------------===//

__global__ void __launch_bounds__(kThreads)
RecvKernel(ChannelView ch, uint8_t* __restrict__ rows, int32_t* __restrict__ group_sizes,
           int32_t* __restrict__ all_counts, int send_blocks) {
  __shared__ RecvTables tb;
  const ChannelShape& s = ch.shape;
  const int p = s.num_ranks, num_local = s.experts_per_rank;
  const u64 epoch = BlockEpoch(ch, kDispatchRecv);
  const int parity = static_cast<int>(epoch & 1);
  WaitForPeers(ch, Counters::DispatchArrive(p, 0),
               u64(send_blocks) * (epoch + 1), "the dispatched rows");
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
  const int32_t vecs = static_cast<int32_t>(s.row_bytes / 16);
  const int64_t offset = s.DispatchOffset();
  CopyVectors(tb.expert_offset[num_local] * vecs,
              [&](int32_t i, const uint4** src, uint4** dst) {
                const int32_t r = i / vecs, v = i % vecs;
                int from;
                int32_t pos;
                Locate(tb, p, num_local, r, from, pos);
                *src = reinterpret_cast<const uint4*>(
                    StagedRow(ch, ch.rank, offset, parity, from, pos)) + v;
                *dst = reinterpret_cast<uint4*>(rows + int64_t{r} * s.row_bytes) + v;
              });
  __syncthreads();
  if (threadIdx.x == 0) SignalPeers(ch, Counters::DispatchAck(p, 0));
  FinishCall(ch, kDispatchRecv);
}

//===----------------------------------------------------------------------===//
// combine send / recv
//===----------------------------------------------------------------------===//

__global__ void __launch_bounds__(kThreads)
CombineSendKernel(ChannelView ch, const uint8_t* __restrict__ y,
                  const int32_t* __restrict__ all_counts, int recv_blocks) {
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
                               u64(recv_blocks) * (epoch - 1), "the combine ack");
  const int32_t vecs = static_cast<int32_t>(s.row_bytes / 16);
  const int64_t offset = s.CombineOffset();
  CopyVectors(tb.expert_offset[num_local] * vecs,
              [&](int32_t i, const uint4** src, uint4** dst) {
                const int32_t r = i / vecs, v = i % vecs;
                int to;
                int32_t pos;
                Locate(tb, p, num_local, r, to, pos);
                *src = reinterpret_cast<const uint4*>(y + int64_t{r} * s.row_bytes) + v;
                *dst = reinterpret_cast<uint4*>(StagedRow(ch, to, offset, parity, ch.rank, pos)) + v;
              });
  __syncthreads();
  if (threadIdx.x == 0) SignalPeers(ch, Counters::CombineArrive(p, 0));
  FinishCall(ch, kCombineSend);
}

template <typename E>
__global__ void __launch_bounds__(kThreads)
CombineRecvKernel(ChannelView ch, const int32_t* __restrict__ expert_ids,
                  const int32_t* __restrict__ slot_pos, const float* __restrict__ weights,
                  typename E::Storage* __restrict__ out, int send_blocks) {
  using S = typename E::Storage;
  constexpr int kPer = 16 / sizeof(S);
  const ChannelShape& s = ch.shape;
  const int p = s.num_ranks;
  const u64 epoch = BlockEpoch(ch, kCombineRecv);
  const int parity = static_cast<int>(epoch & 1);
  WaitForPeers(ch, Counters::CombineArrive(p, 0),
               u64(send_blocks) * (epoch + 1), "the returned rows");
  const int64_t vecs = s.row_bytes / 16;
  const int64_t total = s.tokens * vecs;
  const int64_t offset = s.CombineOffset();
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
      in.vec = __ldcg(reinterpret_cast<const uint4*>(
          StagedRow(ch, ch.rank, offset, parity, d, pos)) + v);
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
  __syncthreads();
  if (threadIdx.x == 0) SignalPeers(ch, Counters::CombineAck(p, 0));
  FinishCall(ch, kCombineRecv);
}

int CopyBlocks(int64_t vectors) {
  const int64_t wanted = (vectors + kThreads - 1) / kThreads;
  return static_cast<int>(wanted < 1 ? 1 : (wanted > kMaxCopyBlocks ? kMaxCopyBlocks : wanted));
}

size_t PlanSmemBytes(const ChannelShape& s) {
  return static_cast<size_t>(34 * s.NumExperts()) * sizeof(int32_t);
}

}  // namespace

cudaError_t ConfigureKernels(const ChannelShape& s) {
  return cudaFuncSetAttribute(PlanKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(PlanSmemBytes(s)));
}

int SendBlocks(const ChannelShape& s) { return CopyBlocks(s.Slots() * (s.row_bytes / 16)); }
int RecvBlocks(const ChannelShape& s) {
  return CopyBlocks(s.num_ranks * s.RowsPerSource() * (s.row_bytes / 16));
}
int CombineSendBlocks(const ChannelShape& s) { return RecvBlocks(s); }
int CombineRecvBlocks(const ChannelShape& s) { return CopyBlocks(s.tokens * (s.row_bytes / 16)); }

cudaError_t LaunchDispatchSend(const ChannelView& ch, const void* x, const int32_t* expert_ids,
                               int32_t* slot_pos, int32_t* send_counts, cudaStream_t stream) {
  const size_t smem = PlanSmemBytes(ch.shape);
  PlanKernel<<<1, kPlanThreads, smem, stream>>>(ch, expert_ids, slot_pos, send_counts);
  SendKernel<<<SendBlocks(ch.shape), kThreads, 0, stream>>>(
      ch, static_cast<const uint8_t*>(x), expert_ids, slot_pos, send_counts,
      RecvBlocks(ch.shape));
  return cudaGetLastError();
}

cudaError_t LaunchDispatchRecv(const ChannelView& ch, void* rows, int32_t* group_sizes,
                               int32_t* all_counts, cudaStream_t stream) {
  RecvKernel<<<RecvBlocks(ch.shape), kThreads, 0, stream>>>(
      ch, static_cast<uint8_t*>(rows), group_sizes, all_counts, SendBlocks(ch.shape));
  return cudaGetLastError();
}

cudaError_t LaunchCombineSend(const ChannelView& ch, const void* y, const int32_t* all_counts,
                              cudaStream_t stream) {
  CombineSendKernel<<<CombineSendBlocks(ch.shape), kThreads, 0, stream>>>(
      ch, static_cast<const uint8_t*>(y), all_counts, CombineRecvBlocks(ch.shape));
  return cudaGetLastError();
}

cudaError_t LaunchCombineRecv(const ChannelView& ch, ElemType type, const int32_t* expert_ids,
                              const int32_t* slot_pos, const float* weights, void* out,
                              cudaStream_t stream) {
  const int blocks = CombineRecvBlocks(ch.shape);
  const int send_blocks = CombineSendBlocks(ch.shape);
  switch (type) {
    case ElemType::kF32:
      CombineRecvKernel<F32><<<blocks, kThreads, 0, stream>>>(
          ch, expert_ids, slot_pos, weights, static_cast<float*>(out), send_blocks);
      break;
    case ElemType::kBF16:
      CombineRecvKernel<BF16><<<blocks, kThreads, 0, stream>>>(
          ch, expert_ids, slot_pos, weights, static_cast<unsigned short*>(out), send_blocks);
      break;
    case ElemType::kF16:
      CombineRecvKernel<F16><<<blocks, kThreads, 0, stream>>>(
          ch, expert_ids, slot_pos, weights, static_cast<unsigned short*>(out), send_blocks);
      break;
  }
  return cudaGetLastError();
}

}  // namespace moe_jax::cuda::nvlink

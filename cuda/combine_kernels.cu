// moe_jax_combine: one launch, a group of blockDim.x threads per token
// (blockIdx.y splits H into spans when there are too few tokens to fill the
// GPU). The group first resolves the token's k slots (source row or absent, and
// weight) into shared memory, then its threads walk H in chunks of kVE
// elements: for each chunk, acc = 0.0f and, in k order,
// acc = fadd_rn(acc, fmul_rn(w, f32(y))) (or fadd_rn(acc, 0.0f) for an
// absent slot), then out = cvt.rn(acc). Loads of kSlotBatch slots are issued
// before their (ordered) accumulation to keep several loads in flight.
#include <algorithm>
#include <cstdint>

#include "launch_shape.h"
#include "pack_combine.h"
#include "vec_access.cuh"

namespace moe_jax::cuda {
namespace {

// Slots per token resolved through shared memory; larger top_k re-reads the
// plan from global memory instead (same results).
constexpr int kSmemSlots = 32;
constexpr int kSlotBatch = 4;

struct SlotRef {
  const void* row;  // nullptr: slot outside both windows
  float weight;
};

template <typename In>
__device__ __forceinline__ SlotRef ResolveSlot(const CombineArgs& a, int64_t t,
                                               int64_t j) {
  using S = typename In::Storage;
  const int64_t n = t * a.top_k + j;
  const int32_t d = __ldg(a.dest + n);
  const int64_t q = static_cast<int64_t>(__ldg(a.pos + n)) - a.start;
  const float w = __ldg(a.weights + n);
  const void* row = nullptr;
  if (d >= 0 && d < a.num_ranks) {
    if (q >= 0 && q < a.cap_rows) {
      row = static_cast<const S*>(a.cap_ret) + (d * a.cap_rows + q) * a.hidden;
    } else if (q >= a.cap_rows && q < a.cap_rows + a.spill_rows) {
      row = static_cast<const S*>(a.spill_ret) +
            (d * a.spill_rows + (q - a.cap_rows)) * a.hidden;
    }
  }
  return {row, w};
}

// Elements [begin, end) of a row: the share of H that one block covers.
struct Span {
  int64_t begin, end;
};

template <typename In, typename Out, int kVE>
__device__ __forceinline__ void CombineToken(const CombineArgs& a, int64_t t,
                                             const SlotRef* slots, Span span) {
  using SIn = typename In::Storage;
  using SOut = typename Out::Storage;
  using InFrag = Fragment<SIn, kVE * static_cast<int>(sizeof(SIn))>;
  using OutFrag = Fragment<SOut, kVE * static_cast<int>(sizeof(SOut))>;

  const int64_t k = a.top_k;
  SOut* out_row = static_cast<SOut*>(a.out) + t * a.hidden;
  const int64_t end = span.end / kVE;  // span ends are multiples of kVE

  for (int64_t c = span.begin / kVE + threadIdx.x; c < end; c += blockDim.x) {
    float acc[kVE];
#pragma unroll
    for (int e = 0; e < kVE; ++e) acc[e] = 0.0f;

    for (int64_t j0 = 0; j0 < k; j0 += kSlotBatch) {
      SlotRef ref[kSlotBatch];
      InFrag y[kSlotBatch];
#pragma unroll
      for (int u = 0; u < kSlotBatch; ++u) {
        ref[u] = {nullptr, 0.0f};
        if (j0 + u < k) {
          ref[u] = slots != nullptr ? slots[j0 + u] : ResolveSlot<In>(a, t, j0 + u);
        }
        if (ref[u].row != nullptr) {
          y[u].Load(static_cast<const SIn*>(ref[u].row) + c * kVE);
        }
      }
#pragma unroll
      for (int u = 0; u < kSlotBatch; ++u) {
        if (j0 + u >= k) break;
        if (ref[u].row != nullptr) {
#pragma unroll
          for (int e = 0; e < kVE; ++e) {
            acc[e] = __fadd_rn(acc[e], __fmul_rn(ref[u].weight, In::ToFloat(y[u].elem[e])));
          }
        } else {
#pragma unroll
          for (int e = 0; e < kVE; ++e) acc[e] = __fadd_rn(acc[e], 0.0f);
        }
      }
    }

    OutFrag o;
#pragma unroll
    for (int e = 0; e < kVE; ++e) o.elem[e] = Out::FromFloat(acc[e]);
    o.Store(out_row + c * kVE);
  }
}

// Widest chunk (kVE elements) whose input and output accesses are aligned:
// H % kVE == 0 keeps every row aligned like its buffer's base pointer.
template <typename In, typename Out, int kVE>
__device__ __forceinline__ void CombineTokenWidest(const CombineArgs& a, int64_t t,
                                                   const SlotRef* slots, Span span,
                                                   uintptr_t align_in,
                                                   uintptr_t align_out) {
  if constexpr (kVE > 1) {
    constexpr int kIn = kAccessBytes<kVE * static_cast<int>(sizeof(typename In::Storage))>;
    constexpr int kOut = kAccessBytes<kVE * static_cast<int>(sizeof(typename Out::Storage))>;
    if (a.hidden % kVE == 0 && (align_in & (kIn - 1)) == 0 &&
        (align_out & (kOut - 1)) == 0) {
      CombineToken<In, Out, kVE>(a, t, slots, span);
    } else {
      CombineTokenWidest<In, Out, kVE / 2>(a, t, slots, span, align_in, align_out);
    }
  } else {
    CombineToken<In, Out, 1>(a, t, slots, span);
  }
}

// Elements per chunk on the widest path: 16 bytes of the narrower of the two
// types (so bf16 -> bf16 moves 8 elements per LDG/STG.128, f32 -> bf16 loads
// 2 x 16 bytes and stores 16 bytes).
template <typename In, typename Out>
inline constexpr int kMaxChunkElems =
    16 / static_cast<int>(sizeof(typename In::Storage) < sizeof(typename Out::Storage)
                              ? sizeof(typename In::Storage)
                              : sizeof(typename Out::Storage));

// blockIdx.y picks a span of span_elems elements (a multiple of the widest
// chunk) of H, so that few tokens still fill the GPU.
template <typename In, typename Out>
__global__ void __launch_bounds__(kBlockThreads)
    CombineKernel(CombineArgs a, int64_t span_elems) {
  __shared__ SlotRef smem[kMaxRowsPerBlock][kSmemSlots];
  const bool use_smem = a.top_k <= kSmemSlots;  // uniform over the grid
  const uintptr_t align_in =
      (a.num_ranks * a.cap_rows > 0 ? reinterpret_cast<uintptr_t>(a.cap_ret) : 0) |
      (a.num_ranks * a.spill_rows > 0 ? reinterpret_cast<uintptr_t>(a.spill_ret) : 0);
  const uintptr_t align_out = reinterpret_cast<uintptr_t>(a.out);
  SlotRef* my_slots = use_smem ? smem[threadIdx.y] : nullptr;
  const int64_t span_begin = static_cast<int64_t>(blockIdx.y) * span_elems;
  const Span span{span_begin, a.hidden - span_begin < span_elems ? a.hidden
                                                               : span_begin + span_elems};

  // The loop bound is the same for the whole block, so the barriers are too.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y;
       base < a.num_tokens; base += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const int64_t t = base + threadIdx.y;
    const bool valid = t < a.num_tokens;
    if (use_smem) {
      if (valid) {
        for (int j = threadIdx.x; j < a.top_k; j += blockDim.x) {
          my_slots[j] = ResolveSlot<In>(a, t, j);
        }
      }
      __syncthreads();
    }
    if (valid) {
      CombineTokenWidest<In, Out, kMaxChunkElems<In, Out>>(a, t, my_slots, span,
                                                            align_in, align_out);
    }
    if (use_smem) __syncthreads();
  }
}

// Blocks wanted before a row is split over blockIdx.y: two waves of the
// three 256-thread blocks an SM holds at this register use, on the 132 SMs of
// an H100/H200.
constexpr int64_t kTargetBlocks = 792;
constexpr int64_t kMaxGridY = 65535;

template <typename In, typename Out>
cudaError_t Launch(const CombineArgs& a, cudaStream_t stream) {
  const int64_t ve = kMaxChunkElems<In, Out>;
  const int64_t chunks = (a.hidden + ve - 1) / ve;
  const LaunchShape shape = ShapeFor(a.num_tokens, chunks, 1);
  // Split H only as far as every thread still gets a chunk.
  int64_t spans = 1;
  if (shape.blocks < kTargetBlocks) {
    spans = std::min({(kTargetBlocks + shape.blocks - 1) / shape.blocks,
                      std::max<int64_t>(1, chunks / shape.threads_per_row), kMaxGridY});
  }
  const int64_t span_elems = (chunks + spans - 1) / spans * ve;
  spans = (a.hidden + span_elems - 1) / span_elems;
  const dim3 grid(shape.blocks, static_cast<unsigned>(spans));
  CombineKernel<In, Out><<<grid, dim3(shape.threads_per_row, shape.rows_per_block),
                           0, stream>>>(a, span_elems);
  return cudaGetLastError();
}

template <typename In>
cudaError_t LaunchForInput(const CombineArgs& a, ElemType out_type,
                           cudaStream_t stream) {
  switch (out_type) {
    case ElemType::kF32: return Launch<In, F32>(a, stream);
    case ElemType::kBF16: return Launch<In, BF16>(a, stream);
    case ElemType::kF16: return Launch<In, F16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchCombine(const CombineArgs& args, ElemType in_type,
                          ElemType out_type, cudaStream_t stream) {
  if (args.num_tokens <= 0 || args.hidden <= 0) return cudaSuccess;
  switch (in_type) {
    case ElemType::kF32: return LaunchForInput<F32>(args, out_type, stream);
    case ElemType::kBF16: return LaunchForInput<BF16>(args, out_type, stream);
    case ElemType::kF16: return LaunchForInput<F16>(args, out_type, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace moe_jax::cuda

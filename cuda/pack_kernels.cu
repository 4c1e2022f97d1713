// moe_jax_pack: one launch fills both cap_buf and spill_buf.
//
// Output rows are numbered cap_buf rows first (p * capacity + c), then
// spill_buf rows (p * spill_capacity + s). A group of blockDim.x threads owns
// one output row: it resolves the source token from the dispatch plan and
// copies the row, or writes zeros when the stream position is past
// send_counts[p]. Every output row is written exactly once.
#include <cstdint>

#include "launch_shape.h"
#include "pack_combine.h"
#include "vec_access.cuh"

namespace moe_jax::cuda {
namespace {

// Accesses each thread keeps in flight per pass of a row copy.
constexpr int kCopyUnroll = 4;

template <int kBytes>
__device__ __forceinline__ void CopyOrZeroRow(const char* __restrict__ src,
                                              char* __restrict__ dst,
                                              int64_t row_bytes) {
  using Frag = Fragment<unsigned char, kBytes>;
  const int64_t n = row_bytes / kBytes;
  const int64_t lanes = blockDim.x;
  int64_t i = threadIdx.x;
  if (src == nullptr) {
    Frag zero;
    zero.Zero();
    for (; i < n; i += lanes) zero.Store(dst + i * kBytes);
    return;
  }
  for (; i + (kCopyUnroll - 1) * lanes < n; i += kCopyUnroll * lanes) {
    Frag f[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) f[u].Load(src + (i + u * lanes) * kBytes);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) f[u].Store(dst + (i + u * lanes) * kBytes);
  }
  for (; i < n; i += lanes) {
    Frag f;
    f.Load(src + i * kBytes);
    f.Store(dst + i * kBytes);
  }
}

// Widest access width (16, 8, 4, 2 or 1 bytes) that divides `align`, the OR
// of the row size and every base pointer. The choice is uniform over the
// grid, so the branch never diverges.
template <int kBytes>
__device__ __forceinline__ void CopyOrZeroRowWidest(uintptr_t align,
                                                    const char* src, char* dst,
                                                    int64_t row_bytes) {
  if constexpr (kBytes > 1) {
    if ((align & (kBytes - 1)) == 0) {
      CopyOrZeroRow<kBytes>(src, dst, row_bytes);
    } else {
      CopyOrZeroRowWidest<kBytes / 2>(align, src, dst, row_bytes);
    }
  } else {
    CopyOrZeroRow<1>(src, dst, row_bytes);
  }
}

__global__ void __launch_bounds__(kBlockThreads) PackKernel(PackArgs a) {
  const int64_t cap_rows = a.num_ranks * a.capacity;
  const int64_t total_rows = cap_rows + a.num_ranks * a.spill_capacity;
  const char* x = static_cast<const char*>(a.x);
  char* cap = static_cast<char*>(a.cap_buf);
  char* spill = static_cast<char*>(a.spill_buf);
  // Empty buffers may come with any pointer; they take no part in the choice.
  const uintptr_t align =
      static_cast<uintptr_t>(a.row_bytes) |
      (a.num_tokens > 0 ? reinterpret_cast<uintptr_t>(x) : 0) |
      (cap_rows > 0 ? reinterpret_cast<uintptr_t>(cap) : 0) |
      (total_rows > cap_rows ? reinterpret_cast<uintptr_t>(spill) : 0);

  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
       row < total_rows; row += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    int64_t p, s;  // destination rank, stream position
    char* dst;
    if (row < cap_rows) {
      p = row / a.capacity;
      s = a.start + (row - p * a.capacity);
      dst = cap + row * a.row_bytes;
    } else {
      const int64_t r = row - cap_rows;
      p = r / a.spill_capacity;
      s = a.start + a.capacity + (r - p * a.spill_capacity);
      dst = spill + r * a.row_bytes;
    }
    // Every thread of the row group resolves the (same) source: broadcast
    // loads, no barrier. Indices outside their operand give a zero row.
    const char* src = nullptr;
    if (s < __ldg(a.send_counts + p)) {
      const int64_t idx = static_cast<int64_t>(__ldg(a.send_offsets + p)) + s;
      if (idx >= 0 && idx < a.num_slots) {
        const int32_t slot = __ldg(a.sorted_slots + idx);
        const int64_t token = slot / a.top_k;
        if (slot >= 0 && token < a.num_tokens) src = x + token * a.row_bytes;
      }
    }
    CopyOrZeroRowWidest<16>(align, src, dst, a.row_bytes);
  }
}

}  // namespace

cudaError_t LaunchPack(const PackArgs& args, cudaStream_t stream) {
  const int64_t rows = args.num_ranks * (args.capacity + args.spill_capacity);
  if (rows <= 0 || args.row_bytes <= 0) return cudaSuccess;
  // Threads per row sized for 16-byte accesses, kCopyUnroll per thread.
  const LaunchShape shape = ShapeFor(rows, (args.row_bytes + 15) / 16, kCopyUnroll);
  PackKernel<<<shape.blocks, dim3(shape.threads_per_row, shape.rows_per_block),
               0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace moe_jax::cuda

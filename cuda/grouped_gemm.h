// Host-side entry point of the grouped GEMM behind moe_jax_grouped_matmul:
// CUTLASS's SM90 (Hopper) grouped GEMM, TMA loads and warpgroup MMA,
// warp-specialized and persistent, with the groups' problem shapes and
// pointers built on the device from group_sizes.
//
// Plain C++ (no device code). LaunchGroupedGemm enqueues a fixed sequence of
// kernels on `stream` (the same for every group_sizes): it never allocates,
// synchronizes or reads device data on the host, so a launch can be captured
// into a CUDA graph and replayed with other group sizes.
#ifndef MOE_JAX_CUDA_GROUPED_GEMM_H_
#define MOE_JAX_CUDA_GROUPED_GEMM_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

namespace moe_jax::cuda {

enum class GemmElem { kBF16, kF16, kF32 };

// What one launch computes. Rows are sorted by group: group g owns rows
// [s_g, s_g + n_g) with n_g = max(group_sizes[g], 0) and s_g the sum of the
// earlier n's, cut at `rows` (M).
enum class GroupedGemmOp {
  // out[M, N] = a[M, K] @ b[g][K, N] for each group's rows; rows past the
  // groups are zero. a, b: `in`; out: bf16/f16 (the dtype of a) or f32.
  kForward,
  // out[M, F] = silu(h[:, gate]) * h[:, up] with h = a[M, K] @ b[g][K, 2F],
  // whose columns alternate blocks of kSwiGLUBlock gate and up columns (see
  // SwiGLUColumn); rows past the groups are zero. out: dtype of a.
  kForwardSwiGLU,
  // out[M, K] = a[M, N] @ b[g][K, N]^T for each group's rows (the input
  // gradient of kForward); rows past the groups are zero.
  kTransposedB,
  // out[G, K, N] = a_g^T @ c_g with a[M, K] and c[M, N] (the weight gradient
  // of kForward: a = x, c = dy); groups without rows are zero. out: dtype of a.
  kWeightGrad,
};

// Gate and up columns of the fused SwiGLU weight alternate in blocks of this
// many columns: column j of the [.., 2F] weight is gate column
// (j / (2 B)) * B + j % B when (j / B) is even, else the up column of that
// index. F must be a multiple of kSwiGLUBlock.
inline constexpr int64_t kSwiGLUBlock = 8;

struct GroupedGemmArgs {
  GroupedGemmOp op = GroupedGemmOp::kForward;
  GemmElem in_type = GemmElem::kBF16;   // a and b (bf16 or f16)
  GemmElem out_type = GemmElem::kBF16;  // see GroupedGemmOp
  const void* a = nullptr;  // kForward*/kWeightGrad: [M, K]; kTransposedB: [M, N]
  const void* b = nullptr;  // kForward*/kTransposedB: [G, K, N]; kWeightGrad: [M, N]
  const int32_t* group_sizes = nullptr;  // [G], on the device
  void* out = nullptr;
  int64_t rows = 0;    // M
  int64_t k = 0;       // K
  int64_t n = 0;       // N (2F for kForwardSwiGLU)
  int64_t groups = 0;  // G
  void* workspace = nullptr;  // GroupedGemmWorkspaceBytes(groups) bytes, 256-byte aligned
  size_t workspace_bytes = 0;
};

// Largest SM count the workspace is sized for; larger GPUs use this many.
inline constexpr int kGroupedGemmMaxSms = 256;

// The workspace: each group's problem shape, operand pointers and strides
// (written on the device by a preparation kernel), then CUTLASS's own
// per-SM state (the TMA descriptors the kernel rewrites between groups).
struct GroupedGemmWorkspace {
  static constexpr size_t kAlign = 256;
  static constexpr size_t kCutlassBytesPerSm = 1024;
  size_t shapes = 0, ptr_a = 0, ptr_b = 0, ptr_d = 0;
  size_t stride_a = 0, stride_b = 0, stride_d = 0, cutlass = 0, end = 0;

  explicit GroupedGemmWorkspace(int64_t groups) {
    const size_t g = groups > 0 ? static_cast<size_t>(groups) : 0;
    shapes = Take(g * 16);
    ptr_a = Take(g * 8);
    ptr_b = Take(g * 8);
    ptr_d = Take(g * 8);
    stride_a = Take(g * 32);
    stride_b = Take(g * 32);
    stride_d = Take(g * 32);
    cutlass = Take(kCutlassBytesPerSm * kGroupedGemmMaxSms);
  }

 private:
  size_t Take(size_t bytes) {
    const size_t here = end;
    end = (end + bytes + kAlign - 1) / kAlign * kAlign;
    return here;
  }
};

// Workspace bytes any op needs for `groups` groups on any supported GPU.
inline size_t GroupedGemmWorkspaceBytes(int64_t groups) {
  return GroupedGemmWorkspace(groups).end;
}

// Shape rules every op needs (TMA: 16-byte aligned rows): K and N multiples
// of 8; for kForwardSwiGLU N / 2 a multiple of kSwiGLUBlock. Returns "" when
// they hold, else what is wrong.
std::string GroupedGemmShapeError(const GroupedGemmArgs& args);

// "" when the current device runs these kernels (compute capability 9.0,
// built for sm_90a), else why not.
std::string GroupedGemmDeviceError();

// Enqueues the op on `stream`. Returns "" on success, else the error (shape,
// device or CUDA launch error text).
std::string LaunchGroupedGemm(const GroupedGemmArgs& args, cudaStream_t stream);

}  // namespace moe_jax::cuda

#endif  // MOE_JAX_CUDA_GROUPED_GEMM_H_

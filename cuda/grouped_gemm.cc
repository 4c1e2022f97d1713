// Validation, device checks and dtype dispatch of the grouped GEMM.
#include "grouped_gemm.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "grouped_gemm_kernels.cuh"

namespace moe_jax::cuda {
namespace {

constexpr int kMaxDevices = 64;
// SM count per device ordinal (0: not yet read), and whether it is sm_90.
std::array<std::atomic<int>, kMaxDevices> sm_counts{};
std::array<std::atomic<int>, kMaxDevices> is_sm90{};

std::string ReadDevice(int* device, int* sm_count) {
  if (cudaError_t err = cudaGetDevice(device); err != cudaSuccess) {
    return std::string("cudaGetDevice: ") + cudaGetErrorString(err);
  }
  if (*device < 0 || *device >= kMaxDevices) return "device ordinal out of range";
  int count = sm_counts[*device].load(std::memory_order_relaxed);
  if (count == 0) {
    int major = 0, minor = 0;
    cudaError_t err = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, *device);
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, *device);
    }
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, *device);
    }
    if (err != cudaSuccess) {
      return std::string("cudaDeviceGetAttribute: ") + cudaGetErrorString(err);
    }
    is_sm90[*device].store(major == 9 && minor == 0 ? 1 : -(major * 10 + minor));
    sm_counts[*device].store(count);
  }
  *sm_count = count < kGroupedGemmMaxSms ? count : kGroupedGemmMaxSms;
  return "";
}

}  // namespace

std::string GroupedGemmShapeError(const GroupedGemmArgs& args) {
  const int64_t limit = int64_t{1} << 31;
  if (args.rows < 0 || args.k < 1 || args.n < 1 || args.groups < 1) {
    return "M >= 0 and K, N, G >= 1 are needed";
  }
  if (args.rows >= limit || args.k >= limit || args.n >= limit || args.groups >= limit) {
    return "M, K, N and G must be below 2^31";
  }
  if (args.k % 8 != 0 || args.n % 8 != 0) {
    return "K and N must be multiples of 8 (16-byte rows for TMA), got K = " +
           std::to_string(args.k) + ", N = " + std::to_string(args.n);
  }
  if (args.op == GroupedGemmOp::kForwardSwiGLU && (args.n / 2) % kSwiGLUBlock != 0) {
    return "the SwiGLU weight's 2F columns need F a multiple of " +
           std::to_string(kSwiGLUBlock) + ", got 2F = " + std::to_string(args.n);
  }
  if (args.in_type == GemmElem::kF32) return "inputs must be bf16 or f16";
  const bool out_is_in = args.out_type == args.in_type;
  const bool out_is_f32 = args.out_type == GemmElem::kF32;
  switch (args.op) {
    case GroupedGemmOp::kForward:
      if (!out_is_in && !out_is_f32) return "the output must be f32 or the inputs' dtype";
      break;
    case GroupedGemmOp::kForwardSwiGLU:
    case GroupedGemmOp::kTransposedB:
    case GroupedGemmOp::kWeightGrad:
      if (!out_is_in) return "the output must have the inputs' dtype";
      break;
  }
  return "";
}

std::string GroupedGemmDeviceError() {
  int device = 0, sm_count = 0;
  if (std::string err = ReadDevice(&device, &sm_count); !err.empty()) return err;
  const int sm90 = is_sm90[device].load();
  if (sm90 != 1) {
    return "needs a Hopper GPU (compute capability 9.0, sm_90a kernels); device " +
           std::to_string(device) + " has compute capability " + std::to_string(-sm90 / 10) +
           "." + std::to_string(-sm90 % 10);
  }
  return "";
}

std::string LaunchGroupedGemm(const GroupedGemmArgs& args, cudaStream_t stream) {
  if (std::string err = GroupedGemmShapeError(args); !err.empty()) return err;
  if (args.workspace_bytes < GroupedGemmWorkspaceBytes(args.groups) ||
      reinterpret_cast<uintptr_t>(args.workspace) % GroupedGemmWorkspace::kAlign != 0) {
    return "workspace must hold " + std::to_string(GroupedGemmWorkspaceBytes(args.groups)) +
           " bytes, 256-byte aligned";
  }
  int device = 0, sm_count = 0;
  if (std::string err = ReadDevice(&device, &sm_count); !err.empty()) return err;
  if (std::string err = GroupedGemmDeviceError(); !err.empty()) return err;
  const bool backward =
      args.op == GroupedGemmOp::kTransposedB || args.op == GroupedGemmOp::kWeightGrad;
  using grouped_gemm::KernelsFor;
  const grouped_gemm::RunFn run =
      args.in_type == GemmElem::kBF16
          ? (backward ? KernelsFor<GemmElem::kBF16, true>() : KernelsFor<GemmElem::kBF16, false>())
          : (backward ? KernelsFor<GemmElem::kF16, true>() : KernelsFor<GemmElem::kF16, false>());
  return run(args, stream, device, sm_count);
}

}  // namespace moe_jax::cuda

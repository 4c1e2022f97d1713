// FFI handler of moe_jax_grouped_matmul on CUDA: validates the operands,
// then enqueues the group preparation kernel and the CUTLASS grouped GEMM on
// XLA's stream. The workspace is a result buffer XLA allocates; nothing is
// allocated, synchronized or read back on the host, and the launches depend
// on shapes and the `op` attribute only (command-buffer compatible).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <cuda_runtime_api.h>

#include "grouped_gemm.h"
#include "handlers_cuda.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_checks.h"

namespace ffi = xla::ffi;

namespace moe_jax::cuda {
namespace {

constexpr std::string_view kGroupedMatmul = "moe_jax_grouped_matmul";

std::optional<GemmElem> GemmType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return GemmElem::kBF16;
    case ffi::DataType::F16: return GemmElem::kF16;
    case ffi::DataType::F32: return GemmElem::kF32;
    default: return std::nullopt;
  }
}

std::optional<GroupedGemmOp> ParseOp(std::string_view op) {
  if (op == "forward") return GroupedGemmOp::kForward;
  if (op == "swiglu") return GroupedGemmOp::kForwardSwiGLU;
  if (op == "transposed") return GroupedGemmOp::kTransposedB;
  if (op == "weight_grad") return GroupedGemmOp::kWeightGrad;
  return std::nullopt;
}

ffi::Error GroupedMatmulImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                             ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer> workspace, std::string_view op_name) {
  const std::optional<GroupedGemmOp> op = ParseOp(op_name);
  if (!op) {
    return ffi::Error::InvalidArgument(
        std::string(kGroupedMatmul) + ": attribute `op` must be forward, swiglu, transposed "
        "or weight_grad, got " + std::string(op_name));
  }
  const std::optional<GemmElem> in = GemmType(a.element_type());
  if (!in || *in == GemmElem::kF32 || a.dimensions().size() != 2) {
    return Bad(kGroupedMatmul, "a", "bf16 or f16 of rank 2", a);
  }
  const std::string_view at = DTypeName(a.element_type());
  const int64_t M = a.dimensions()[0];
  if (!IsS32Vector(group_sizes)) {
    return Bad(kGroupedMatmul, "group_sizes", "s32[G]", group_sizes);
  }
  const int64_t G = group_sizes.dimensions()[0];

  GroupedGemmArgs args;
  args.op = *op;
  args.in_type = *in;
  args.rows = M;
  args.groups = G;
  std::string out_shape;
  bool out_ok = false;
  if (*op == GroupedGemmOp::kWeightGrad) {
    args.k = a.dimensions()[1];
    if (b.element_type() != a.element_type() || b.dimensions().size() != 2 ||
        b.dimensions()[0] != M) {
      return Bad(kGroupedMatmul, "b", std::string(at) + "[" + std::to_string(M) + ", N]", b);
    }
    args.n = b.dimensions()[1];
    out_shape = Shape(at, {G, args.k, args.n});
    out_ok = out->element_type() == a.element_type() && HasDims(*out, {G, args.k, args.n});
  } else {
    if (b.element_type() != a.element_type() || b.dimensions().size() != 3 ||
        b.dimensions()[0] != G) {
      return Bad(kGroupedMatmul, "b", std::string(at) + "[G = " + std::to_string(G) + ", K, N]",
                 b);
    }
    args.k = b.dimensions()[1];
    args.n = b.dimensions()[2];
    const int64_t a_cols = *op == GroupedGemmOp::kTransposedB ? args.n : args.k;
    if (a.dimensions()[1] != a_cols) {
      return Bad(kGroupedMatmul, "a", Shape(at, {M, a_cols}) + " (from b)", a);
    }
    const int64_t out_cols = *op == GroupedGemmOp::kForward         ? args.n
                             : *op == GroupedGemmOp::kForwardSwiGLU ? args.n / 2
                                                                    : args.k;
    const bool f32_ok = *op == GroupedGemmOp::kForward;
    out_shape = Shape(at, {M, out_cols}) + (f32_ok ? " or f32" : "");
    out_ok = HasDims(*out, {M, out_cols}) &&
             (out->element_type() == a.element_type() ||
              (f32_ok && out->element_type() == ffi::DataType::F32));
  }
  if (!out_ok) return BadResult(kGroupedMatmul, "out", out_shape, *out);
  args.out_type = *GemmType(out->element_type());
  const size_t ws_bytes = GroupedGemmWorkspaceBytes(G);
  if (workspace->element_type() != ffi::DataType::U8 ||
      !HasDims(*workspace, {static_cast<int64_t>(ws_bytes)})) {
    return BadResult(kGroupedMatmul, "workspace",
                     Shape("u8", {static_cast<int64_t>(ws_bytes)}), *workspace);
  }
  if (std::string err = GroupedGemmShapeError(args); !err.empty()) {
    return ffi::Error::InvalidArgument(std::string(kGroupedMatmul) + ": " + err);
  }
  if (M == 0 && *op != GroupedGemmOp::kWeightGrad) return ffi::Error::Success();
  args.a = a.untyped_data();
  args.b = b.untyped_data();
  args.group_sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  args.out = out->untyped_data();
  args.workspace = workspace->untyped_data();
  args.workspace_bytes = ws_bytes;
  if (std::string err = LaunchGroupedGemm(args, stream); !err.empty()) {
    return ffi::Error::Internal(std::string(kGroupedMatmul) + ": " + err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_jax::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeJaxGroupedMatmulCuda, moe_jax::cuda::GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // group_sizes
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<std::string_view>("op"),
                              {ffi::Traits::kCmdBufferCompatible});

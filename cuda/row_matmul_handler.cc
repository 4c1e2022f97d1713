// FFI handler of moe_jax_row_matmul on CUDA: validates the operands, then
// enqueues one kernel on XLA's stream: no allocation, no synchronization, no
// host reads of device data (command-buffer compatible).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <cuda_runtime_api.h>

#include "handlers_cuda.h"
#include "row_matmul.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_checks.h"

namespace ffi = xla::ffi;

namespace moe_jax::cuda {
namespace {

constexpr std::string_view kRowMatmul = "moe_jax_row_matmul";

ffi::Error RowMatmulImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> out) {
  const std::optional<ElemType> type = ToFloatType(x.element_type());
  if (!type || *type == ElemType::kF16 || x.dimensions().size() != 2) {
    return Bad(kRowMatmul, "x", "f32 or bf16 of rank 2 [M, K]", x);
  }
  const int64_t M = x.dimensions()[0];
  const int64_t K = x.dimensions()[1];
  const std::string_view xt = DTypeName(x.element_type());
  if (w.element_type() != x.element_type() || w.dimensions().size() != 3 ||
      w.dimensions()[1] != K) {
    return Bad(kRowMatmul, "w",
               std::string(xt) + "[G, " + std::to_string(K) + ", N] (dtype and K of x)", w);
  }
  const int64_t G = w.dimensions()[0];
  const int64_t N = w.dimensions()[2];
  if (!IsS32Vector(group_sizes) || group_sizes.dimensions()[0] != G) {
    return Bad(kRowMatmul, "group_sizes", Shape("s32", {G}) + " (G of w)", group_sizes);
  }
  if (out->element_type() != ffi::DataType::F32 || !HasDims(*out, {M, N})) {
    return BadResult(kRowMatmul, "out", Shape("f32", {M, N}), *out);
  }
  if (RowMatmulColTiles(N) > kRowMatmulMaxColTiles) {
    return Bad(kRowMatmul, "w",
               "at most " + std::to_string(kRowMatmulMaxColTiles * kRowMatmulTileCols) +
                   " columns (N)",
               w);
  }
  if (RowMatmulRowTiles(M, G, RowMatmulTileRowsFor(M, *type)) > kRowMatmulMaxRowTiles) {
    return Bad(kRowMatmul, "x", "small enough for one launch (M / 16 + G < 2^31)", x);
  }

  RowMatmulArgs args;
  args.x = x.untyped_data();
  args.w = w.untyped_data();
  args.group_sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  args.out = static_cast<float*>(out->untyped_data());
  args.rows = M;
  args.depth = K;
  args.cols = N;
  args.groups = G;
  if (cudaError_t err = LaunchRowMatmul(args, *type, stream); err != cudaSuccess) {
    return LaunchError(kRowMatmul, err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_jax::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeJaxRowMatmulCuda, moe_jax::cuda::RowMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // group_sizes
                                  .Ret<ffi::AnyBuffer>(),  // out
                              {ffi::Traits::kCmdBufferCompatible});

// FFI handlers for moe_jax_pack and moe_jax_combine on CUDA. They validate
// the operands, then enqueue one kernel on XLA's stream: no allocation, no
// synchronization, no host reads of device data (command-buffer compatible).
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <cuda_runtime_api.h>

#include "handlers_cuda.h"
#include "pack_combine.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_checks.h"

namespace ffi = xla::ffi;

namespace moe_jax::cuda {
namespace {

// Any start at or past this bound selects no stream position (positions and
// counts are int32), so clamping to it changes nothing and rules out int64
// overflow in the kernels' index arithmetic.
constexpr int64_t kStartClamp = int64_t{1} << 40;

constexpr std::string_view kPack = "moe_jax_pack";
constexpr std::string_view kCombine = "moe_jax_combine";

ffi::Error PackImpl(cudaStream_t stream, ffi::AnyBuffer x,
                    ffi::AnyBuffer sorted_slots, ffi::AnyBuffer send_offsets,
                    ffi::AnyBuffer send_counts,
                    ffi::Result<ffi::AnyBuffer> cap_buf,
                    ffi::Result<ffi::AnyBuffer> spill_buf, int64_t top_k,
                    int64_t start, int64_t capacity, int64_t spill_capacity) {
  if (top_k < 1) return BadAttr(kPack, "top_k", top_k, ">= 1");
  if (start < 0) return BadAttr(kPack, "start", start, ">= 0");
  if (capacity < 0) return BadAttr(kPack, "capacity", capacity, ">= 0");
  if (spill_capacity < 0) {
    return BadAttr(kPack, "spill_capacity", spill_capacity, ">= 0");
  }

  const std::optional<ElemType> type = ToFloatType(x.element_type());
  if (!type || x.dimensions().size() != 2) {
    return Bad(kPack, "x", "f32, bf16 or f16 of rank 2 [T, H]", x);
  }
  const int64_t T = x.dimensions()[0];
  const int64_t H = x.dimensions()[1];
  if (!IsS32Vector(sorted_slots) || sorted_slots.dimensions()[0] % top_k != 0 ||
      sorted_slots.dimensions()[0] / top_k != T) {
    return Bad(kPack, "sorted_slots",
               "s32[N] with N = T * top_k = " + std::to_string(T) + " * " +
                   std::to_string(top_k),
               sorted_slots);
  }
  const int64_t N = sorted_slots.dimensions()[0];
  if (!IsS32Vector(send_offsets)) {
    return Bad(kPack, "send_offsets", "s32[P]", send_offsets);
  }
  const int64_t P = send_offsets.dimensions()[0];
  if (!IsS32Vector(send_counts) || send_counts.dimensions()[0] != P) {
    return Bad(kPack, "send_counts", Shape("s32", {P}), send_counts);
  }
  const std::string_view xt = DTypeName(x.element_type());
  if (cap_buf->element_type() != x.element_type() ||
      !HasDims(*cap_buf, {P, capacity, H})) {
    return BadResult(kPack, "cap_buf", Shape(xt, {P, capacity, H}), *cap_buf);
  }
  if (spill_buf->element_type() != x.element_type() ||
      !HasDims(*spill_buf, {P, spill_capacity, H})) {
    return BadResult(kPack, "spill_buf", Shape(xt, {P, spill_capacity, H}),
               *spill_buf);
  }

  PackArgs args;
  args.x = x.untyped_data();
  args.sorted_slots = static_cast<const int32_t*>(sorted_slots.untyped_data());
  args.send_offsets = static_cast<const int32_t*>(send_offsets.untyped_data());
  args.send_counts = static_cast<const int32_t*>(send_counts.untyped_data());
  args.cap_buf = cap_buf->untyped_data();
  args.spill_buf = spill_buf->untyped_data();
  args.num_tokens = T;
  args.num_slots = N;
  args.num_ranks = P;
  args.row_bytes = H * ElemBytes(*type);
  args.top_k = top_k;
  args.start = std::min(start, kStartClamp);
  args.capacity = capacity;
  args.spill_capacity = spill_capacity;
  if (cudaError_t err = LaunchPack(args, stream); err != cudaSuccess) {
    return LaunchError(kPack, err);
  }
  return ffi::Error::Success();
}

ffi::Error CombineImpl(cudaStream_t stream, ffi::AnyBuffer cap_ret,
                       ffi::AnyBuffer spill_ret, ffi::AnyBuffer dest,
                       ffi::AnyBuffer pos, ffi::AnyBuffer weights,
                       ffi::Result<ffi::AnyBuffer> out, int64_t start) {
  if (start < 0) return BadAttr(kCombine, "start", start, ">= 0");

  const std::optional<ElemType> in_type = ToFloatType(cap_ret.element_type());
  if (!in_type || cap_ret.dimensions().size() != 3) {
    return Bad(kCombine, "cap_ret", "f32, bf16 or f16 of rank 3 [P, C, H]", cap_ret);
  }
  const int64_t P = cap_ret.dimensions()[0];
  const int64_t C = cap_ret.dimensions()[1];
  const int64_t H = cap_ret.dimensions()[2];
  const std::string_view it = DTypeName(cap_ret.element_type());
  if (spill_ret.element_type() != cap_ret.element_type() ||
      spill_ret.dimensions().size() != 3 || spill_ret.dimensions()[0] != P ||
      spill_ret.dimensions()[2] != H) {
    return Bad(kCombine, "spill_ret",
               std::string(it) + "[" + std::to_string(P) + ", S, " +
                   std::to_string(H) + "] (dtype, P and H of cap_ret)",
               spill_ret);
  }
  const int64_t S = spill_ret.dimensions()[1];
  if (weights.element_type() != ffi::DataType::F32 ||
      weights.dimensions().size() != 2) {
    return Bad(kCombine, "weights", "f32 of rank 2 [T, k]", weights);
  }
  const int64_t T = weights.dimensions()[0];
  const int64_t k = weights.dimensions()[1];
  const int64_t N = T * k;  // both are dimensions of a real buffer
  if (!IsS32Vector(dest) || dest.dimensions()[0] != N) {
    return Bad(kCombine, "dest", Shape("s32", {N}) + " (N = T * k of weights)", dest);
  }
  if (!IsS32Vector(pos) || pos.dimensions()[0] != N) {
    return Bad(kCombine, "pos", Shape("s32", {N}) + " (N = T * k of weights)", pos);
  }
  const std::optional<ElemType> out_type = ToFloatType(out->element_type());
  if (!out_type || !HasDims(*out, {T, H})) {
    return BadResult(kCombine, "out",
               "f32, bf16 or f16 of shape [" + std::to_string(T) + ", " +
                   std::to_string(H) + "]",
               *out);
  }

  CombineArgs args;
  args.cap_ret = cap_ret.untyped_data();
  args.spill_ret = spill_ret.untyped_data();
  args.dest = static_cast<const int32_t*>(dest.untyped_data());
  args.pos = static_cast<const int32_t*>(pos.untyped_data());
  args.weights = static_cast<const float*>(weights.untyped_data());
  args.out = out->untyped_data();
  args.num_tokens = T;
  args.hidden = H;
  args.top_k = k;
  args.num_ranks = P;
  args.cap_rows = C;
  args.spill_rows = S;
  args.start = std::min(start, kStartClamp);
  if (cudaError_t err = LaunchCombine(args, *in_type, *out_type, stream);
      err != cudaSuccess) {
    return LaunchError(kCombine, err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_jax::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeJaxPackCuda, moe_jax::cuda::PackImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // sorted_slots
                                  .Arg<ffi::AnyBuffer>()  // send_offsets
                                  .Arg<ffi::AnyBuffer>()  // send_counts
                                  .Ret<ffi::AnyBuffer>()  // cap_buf
                                  .Ret<ffi::AnyBuffer>()  // spill_buf
                                  .Attr<int64_t>("top_k")
                                  .Attr<int64_t>("start")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("spill_capacity"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeJaxCombineCuda, moe_jax::cuda::CombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // cap_ret
                                  .Arg<ffi::AnyBuffer>()  // spill_ret
                                  .Arg<ffi::AnyBuffer>()  // dest
                                  .Arg<ffi::AnyBuffer>()  // pos
                                  .Arg<ffi::AnyBuffer>()  // weights
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<int64_t>("start"),
                              {ffi::Traits::kCmdBufferCompatible});

// FFI handlers of the NVLink transport: moe_jax_nvlink_dispatch and
// moe_jax_nvlink_combine (both halves in one call), and the halves alone,
// moe_jax_nvlink_{dispatch,combine}_{send,recv}. Every call carries the channel's attributes
//
//   device_ordinals: i64[G * P] CUDA device of every group member, each
//                    group in rank order; group_size: P
//   experts_per_rank, tokens, top_k, row_bytes (H * itemsize)
//
// The prepare stage creates the channel of every group (allocation, peer
// access: host work done before any launch or graph capture). The execute
// stage finds this device's group and rank and enqueues kernels only
// (command-buffer compatible).
#include "nvlink_handlers.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "ffi_messages.h"
#include "nvlink_channel.h"
#include "nvlink_registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_jax::cuda::nvlink {
namespace {

constexpr std::string_view kName = "moe_jax_nvlink";

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(kName) + ": " + what);
}

struct Attrs {
  ffi::Span<const int64_t> device_ordinals;
  int64_t group_size, experts_per_rank, tokens, top_k, row_bytes;
};

ffi::Error ShapeOf(const Attrs& a, ChannelShape* shape) {
  if (a.group_size < 1 || a.group_size > kMaxRanks) {
    return Invalid("attribute `group_size` must be in [1, " + std::to_string(kMaxRanks) +
                   "] (one NVLink domain), got " + std::to_string(a.group_size));
  }
  if (a.device_ordinals.size() == 0 || a.device_ordinals.size() % a.group_size != 0) {
    return Invalid("attribute `device_ordinals` must hold G * group_size ids, got " +
                   std::to_string(a.device_ordinals.size()));
  }
  if (a.experts_per_rank < 1 || a.experts_per_rank > kMaxLocalExperts ||
      a.group_size * a.experts_per_rank > kMaxExperts) {
    return Invalid("attribute `experts_per_rank` must be in [1, " +
                   std::to_string(kMaxLocalExperts) + "] with group_size * experts_per_rank <= " +
                   std::to_string(kMaxExperts) + ", got " + std::to_string(a.experts_per_rank));
  }
  if (a.tokens < 1 || a.top_k < 1 || a.tokens * a.top_k > (int64_t{1} << 30)) {
    return Invalid("attributes `tokens` and `top_k` must be >= 1 with tokens * top_k < 2^30, "
                   "got " + std::to_string(a.tokens) + " and " + std::to_string(a.top_k));
  }
  if (a.row_bytes < 16 || a.row_bytes % 16 != 0) {
    return Invalid("attribute `row_bytes` (H * itemsize) must be a positive multiple of 16, "
                   "got " + std::to_string(a.row_bytes));
  }
  const int64_t vectors_per_row = a.row_bytes / 16;
  const int64_t per_source = a.tokens * std::min(a.top_k, a.experts_per_rank);
  if (a.tokens * a.top_k * vectors_per_row >= (int64_t{1} << 31) ||
      a.group_size * per_source * vectors_per_row >= (int64_t{1} << 31)) {
    return Invalid("tokens * top_k * H * itemsize / 16 and P * tokens * min(top_k, "
                   "experts_per_rank) * H * itemsize / 16 must stay below 2^31");
  }
  shape->num_ranks = static_cast<int32_t>(a.group_size);
  shape->experts_per_rank = static_cast<int32_t>(a.experts_per_rank);
  shape->tokens = a.tokens;
  shape->top_k = static_cast<int32_t>(a.top_k);
  shape->row_bytes = a.row_bytes;
  return ffi::Error::Success();
}

std::vector<int> Group(const Attrs& a, size_t g) {
  std::vector<int> ordinals;
  for (int64_t r = 0; r < a.group_size; ++r) {
    ordinals.push_back(static_cast<int>(a.device_ordinals[g * a.group_size + r]));
  }
  return ordinals;
}

ffi::Error Prepare(const Attrs& a) {
  ChannelShape shape;
  if (ffi::Error err = ShapeOf(a, &shape); err.failure()) return err;
  for (size_t g = 0; g * a.group_size < a.device_ordinals.size(); ++g) {
    std::string error;
    if (GetChannel(Group(a, g), shape, &error) == nullptr) return Invalid(error);
  }
  return ffi::Error::Success();
}

// This device's channel and rank.
ffi::Error Find(const Attrs& a, int32_t device, const Channel** channel, int* rank) {
  ChannelShape shape;
  if (ffi::Error err = ShapeOf(a, &shape); err.failure()) return err;
  for (size_t i = 0; i < a.device_ordinals.size(); ++i) {
    if (a.device_ordinals[i] != device) continue;
    std::vector<int> group = Group(a, i / a.group_size);
    *rank = static_cast<int>(i % a.group_size);
    *channel = FindChannel(group, shape);
    if (*channel == nullptr) {
      std::string error;
      *channel = GetChannel(group, shape, &error);
      if (*channel == nullptr) return Invalid(error);
    }
    return ffi::Error::Success();
  }
  return Invalid("GPU " + std::to_string(device) +
                 " is not in attribute `device_ordinals` (the devices of the mesh)");
}

ffi::Error Launched(std::string_view call, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(kName) + "_" + std::string(call) +
                              ": kernel launch failed: " + cudaGetErrorName(err) + ": " +
                              cudaGetErrorString(err));
}

ffi::Error Need(bool ok, std::string_view call, std::string_view what, const std::string& want,
                const ffi::AnyBuffer& got) {
  if (ok) return ffi::Error::Success();
  return Invalid(std::string(call) + ": " + std::string(what) + " must be " + want + ", got " +
                 Describe(got));
}

ffi::Error PrepareImpl(ffi::Span<const int64_t> device_ordinals, int64_t group_size,
                       int64_t experts_per_rank, int64_t tokens, int64_t top_k,
                       int64_t row_bytes) {
  return Prepare({device_ordinals, group_size, experts_per_rank, tokens, top_k, row_bytes});
}

ffi::Error DispatchSendImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                            ffi::AnyBuffer expert_ids, ffi::Result<ffi::AnyBuffer> slot_pos,
                            ffi::Result<ffi::AnyBuffer> send_counts,
                            ffi::Span<const int64_t> device_ordinals, int64_t group_size,
                            int64_t experts_per_rank, int64_t tokens, int64_t top_k,
                            int64_t row_bytes) {
  const Attrs a{device_ordinals, group_size, experts_per_rank, tokens, top_k, row_bytes};
  const Channel* ch = nullptr;
  int rank = 0;
  if (ffi::Error err = Find(a, device, &ch, &rank); err.failure()) return err;
  const std::optional<ElemType> type = FloatType(x.element_type());
  if (auto e = Need(type && HasDims(x, {tokens, row_bytes / ElemBytes(*type)}), "dispatch_send",
                    "operand `x`", "f32/bf16/f16 [tokens, row_bytes / itemsize]", x);
      e.failure()) {
    return e;
  }
  if (auto e = Need(expert_ids.element_type() == ffi::DataType::S32 &&
                        HasDims(expert_ids, {tokens, top_k}),
                    "dispatch_send", "operand `expert_ids`", Shape("s32", {tokens, top_k}),
                    expert_ids);
      e.failure()) {
    return e;
  }
  return Launched("dispatch_send",
                  LaunchDispatchSend(ch->ViewFrom(rank), x.untyped_data(),
                                     static_cast<const int32_t*>(expert_ids.untyped_data()),
                                     static_cast<int32_t*>(slot_pos->untyped_data()),
                                     static_cast<int32_t*>(send_counts->untyped_data()), stream));
}

ffi::Error DispatchRecvImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer /*slot_pos*/,
                            ffi::Result<ffi::AnyBuffer> rows,
                            ffi::Result<ffi::AnyBuffer> group_sizes,
                            ffi::Result<ffi::AnyBuffer> all_counts,
                            ffi::Span<const int64_t> device_ordinals, int64_t group_size,
                            int64_t experts_per_rank, int64_t tokens, int64_t top_k,
                            int64_t row_bytes) {
  const Attrs a{device_ordinals, group_size, experts_per_rank, tokens, top_k, row_bytes};
  const Channel* ch = nullptr;
  int rank = 0;
  if (ffi::Error err = Find(a, device, &ch, &rank); err.failure()) return err;
  const int64_t want_rows = group_size * ch->shape.RowsPerSource();
  const std::optional<ElemType> type = FloatType(rows->element_type());
  if (auto e = Need(type && HasDims(*rows, {want_rows, row_bytes / ElemBytes(*type)}),
                    "dispatch_recv", "result `rows`",
                    "[P * tokens * min(top_k, experts_per_rank) = " + std::to_string(want_rows) +
                        ", H]",
                    *rows);
      e.failure()) {
    return e;
  }
  return Launched("dispatch_recv",
                  LaunchDispatchRecv(ch->ViewFrom(rank), rows->untyped_data(),
                                     static_cast<int32_t*>(group_sizes->untyped_data()),
                                     static_cast<int32_t*>(all_counts->untyped_data()), stream));
}

ffi::Error CombineSendImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y,
                           ffi::AnyBuffer all_counts, ffi::Result<ffi::AnyBuffer> /*done*/,
                           ffi::Span<const int64_t> device_ordinals, int64_t group_size,
                           int64_t experts_per_rank, int64_t tokens, int64_t top_k,
                           int64_t row_bytes) {
  const Attrs a{device_ordinals, group_size, experts_per_rank, tokens, top_k, row_bytes};
  const Channel* ch = nullptr;
  int rank = 0;
  if (ffi::Error err = Find(a, device, &ch, &rank); err.failure()) return err;
  const int64_t want_rows = group_size * ch->shape.RowsPerSource();
  const std::optional<ElemType> type = FloatType(y.element_type());
  if (auto e = Need(type && HasDims(y, {want_rows, row_bytes / ElemBytes(*type)}),
                    "combine_send", "operand `y`",
                    "[" + std::to_string(want_rows) + ", H] in the dispatched dtype", y);
      e.failure()) {
    return e;
  }
  if (auto e = Need(all_counts.element_type() == ffi::DataType::S32 &&
                        HasDims(all_counts, {group_size, group_size, experts_per_rank}),
                    "combine_send", "operand `all_counts`",
                    Shape("s32", {group_size, group_size, experts_per_rank}), all_counts);
      e.failure()) {
    return e;
  }
  return Launched("combine_send",
                  LaunchCombineSend(ch->ViewFrom(rank), y.untyped_data(),
                                    static_cast<const int32_t*>(all_counts.untyped_data()),
                                    stream));
}

ffi::Error CombineRecvImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer /*done*/,
                           ffi::AnyBuffer expert_ids, ffi::AnyBuffer slot_pos,
                           ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Span<const int64_t> device_ordinals, int64_t group_size,
                           int64_t experts_per_rank, int64_t tokens, int64_t top_k,
                           int64_t row_bytes) {
  const Attrs a{device_ordinals, group_size, experts_per_rank, tokens, top_k, row_bytes};
  const Channel* ch = nullptr;
  int rank = 0;
  if (ffi::Error err = Find(a, device, &ch, &rank); err.failure()) return err;
  const std::optional<ElemType> type = FloatType(out->element_type());
  if (auto e = Need(type && HasDims(*out, {tokens, row_bytes / ElemBytes(*type)}),
                    "combine_recv", "result `out`", "[tokens, H] in the dispatched dtype", *out);
      e.failure()) {
    return e;
  }
  for (auto [name, buf, dtype] :
       {std::tuple{"expert_ids", &expert_ids, ffi::DataType::S32},
        std::tuple{"slot_pos", &slot_pos, ffi::DataType::S32},
        std::tuple{"weights", &weights, ffi::DataType::F32}}) {
    if (auto e = Need(buf->element_type() == dtype && HasDims(*buf, {tokens, top_k}),
                      "combine_recv", std::string("operand `") + name + "`",
                      Shape(DTypeName(dtype), {tokens, top_k}), *buf);
        e.failure()) {
      return e;
    }
  }
  return Launched("combine_recv",
                  LaunchCombineRecv(ch->ViewFrom(rank), *type,
                                    static_cast<const int32_t*>(expert_ids.untyped_data()),
                                    static_cast<const int32_t*>(slot_pos.untyped_data()),
                                    static_cast<const float*>(weights.untyped_data()),
                                    out->untyped_data(), stream));
}

// Both halves in one call: nothing XLA schedules can come between them, so
// consecutive calls of a channel always alternate send and receive.
ffi::Error DispatchImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                        ffi::AnyBuffer expert_ids, ffi::Result<ffi::AnyBuffer> slot_pos,
                        ffi::Result<ffi::AnyBuffer> send_counts,
                        ffi::Result<ffi::AnyBuffer> rows,
                        ffi::Result<ffi::AnyBuffer> group_sizes,
                        ffi::Result<ffi::AnyBuffer> all_counts,
                        ffi::Span<const int64_t> device_ordinals, int64_t group_size,
                        int64_t experts_per_rank, int64_t tokens, int64_t top_k,
                        int64_t row_bytes) {
  if (ffi::Error e = DispatchSendImpl(stream, device, x, expert_ids, slot_pos, send_counts,
                                      device_ordinals, group_size, experts_per_rank, tokens,
                                      top_k, row_bytes);
      e.failure()) {
    return e;
  }
  return DispatchRecvImpl(stream, device, x, rows, group_sizes, all_counts, device_ordinals,
                          group_size, experts_per_rank, tokens, top_k, row_bytes);
}

ffi::Error CombineImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y,
                       ffi::AnyBuffer all_counts, ffi::AnyBuffer expert_ids,
                       ffi::AnyBuffer slot_pos, ffi::AnyBuffer weights,
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::Span<const int64_t> device_ordinals, int64_t group_size,
                       int64_t experts_per_rank, int64_t tokens, int64_t top_k,
                       int64_t row_bytes) {
  if (ffi::Error e = CombineSendImpl(stream, device, y, all_counts, out, device_ordinals,
                                     group_size, experts_per_rank, tokens, top_k, row_bytes);
      e.failure()) {
    return e;
  }
  return CombineRecvImpl(stream, device, y, expert_ids, slot_pos, weights, out,
                         device_ordinals, group_size, experts_per_rank, tokens, top_k,
                         row_bytes);
}

template <typename Binding>
auto WithAttrs(Binding&& b) {
  return std::forward<Binding>(b).template Attr<ffi::Span<const int64_t>>("device_ordinals")
      .template Attr<int64_t>("group_size")
      .template Attr<int64_t>("experts_per_rank")
      .template Attr<int64_t>("tokens")
      .template Attr<int64_t>("top_k")
      .template Attr<int64_t>("row_bytes");
}

}  // namespace
}  // namespace moe_jax::cuda::nvlink

namespace nv = moe_jax::cuda::nvlink;

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeJaxNvlinkPrepare, nv::PrepareImpl,
                              nv::WithAttrs(ffi::Ffi::BindPrepare()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeJaxNvlinkDispatchSend, nv::DispatchSendImpl,
    nv::WithAttrs(ffi::Ffi::BindExecute()
                      .Ctx<ffi::PlatformStream<cudaStream_t>>()
                      .Ctx<ffi::DeviceOrdinal>()
                      .Arg<ffi::AnyBuffer>()    // x
                      .Arg<ffi::AnyBuffer>()    // expert_ids
                      .Ret<ffi::AnyBuffer>()    // slot_pos
                      .Ret<ffi::AnyBuffer>()),  // send_counts
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeJaxNvlinkDispatchRecv, nv::DispatchRecvImpl,
    nv::WithAttrs(ffi::Ffi::BindExecute()
                      .Ctx<ffi::PlatformStream<cudaStream_t>>()
                      .Ctx<ffi::DeviceOrdinal>()
                      .Arg<ffi::AnyBuffer>()    // slot_pos (orders recv after send)
                      .Ret<ffi::AnyBuffer>()    // rows
                      .Ret<ffi::AnyBuffer>()    // group_sizes
                      .Ret<ffi::AnyBuffer>()),  // all_counts
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeJaxNvlinkCombineSend, nv::CombineSendImpl,
    nv::WithAttrs(ffi::Ffi::BindExecute()
                      .Ctx<ffi::PlatformStream<cudaStream_t>>()
                      .Ctx<ffi::DeviceOrdinal>()
                      .Arg<ffi::AnyBuffer>()    // y
                      .Arg<ffi::AnyBuffer>()    // all_counts
                      .Ret<ffi::AnyBuffer>()),  // done (orders recv after send)
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeJaxNvlinkCombineRecv, nv::CombineRecvImpl,
    nv::WithAttrs(ffi::Ffi::BindExecute()
                      .Ctx<ffi::PlatformStream<cudaStream_t>>()
                      .Ctx<ffi::DeviceOrdinal>()
                      .Arg<ffi::AnyBuffer>()    // done
                      .Arg<ffi::AnyBuffer>()    // expert_ids
                      .Arg<ffi::AnyBuffer>()    // slot_pos
                      .Arg<ffi::AnyBuffer>()    // weights
                      .Ret<ffi::AnyBuffer>()),  // out
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeJaxNvlinkDispatch, nv::DispatchImpl,
    nv::WithAttrs(ffi::Ffi::BindExecute()
                      .Ctx<ffi::PlatformStream<cudaStream_t>>()
                      .Ctx<ffi::DeviceOrdinal>()
                      .Arg<ffi::AnyBuffer>()    // x
                      .Arg<ffi::AnyBuffer>()    // expert_ids
                      .Ret<ffi::AnyBuffer>()    // slot_pos
                      .Ret<ffi::AnyBuffer>()    // send_counts
                      .Ret<ffi::AnyBuffer>()    // rows
                      .Ret<ffi::AnyBuffer>()    // group_sizes
                      .Ret<ffi::AnyBuffer>()),  // all_counts
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeJaxNvlinkCombine, nv::CombineImpl,
    nv::WithAttrs(ffi::Ffi::BindExecute()
                      .Ctx<ffi::PlatformStream<cudaStream_t>>()
                      .Ctx<ffi::DeviceOrdinal>()
                      .Arg<ffi::AnyBuffer>()    // y
                      .Arg<ffi::AnyBuffer>()    // all_counts
                      .Arg<ffi::AnyBuffer>()    // expert_ids
                      .Arg<ffi::AnyBuffer>()    // slot_pos
                      .Arg<ffi::AnyBuffer>()    // weights
                      .Ret<ffi::AnyBuffer>()),  // out
    {ffi::Traits::kCmdBufferCompatible});

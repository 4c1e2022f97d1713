// FFI handlers of the NVLink transport: moe_jax_nvlink_dispatch and
// moe_jax_nvlink_combine (both halves in one call), their fp8-dispatch
// forms (moe_jax_nvlink_dispatch_fp8, moe_jax_nvlink_dispatch_recv_fp8),
// and the halves alone, moe_jax_nvlink_{dispatch,combine}_{send,recv}.
// Every call carries the channel's attributes
//
//   device_ordinals: i64[G * P] CUDA device of every group member in its
//                    own process, each group in rank order; group_size: P
//   experts_per_rank, tokens, top_k, row_bytes (H * itemsize of x)
//   dispatch_fp8: 1 to dispatch bf16 x as e4m3 with per-128 f32 scales
//   multi_process: 1 when the mesh spans processes
//   replica_groups: i64[G * P] the groups as flattened device ids (XLA's
//                   partition ids), for XLA's communicator (multi_process)
//
// One process: the prepare stage creates the channel of every group
// (allocation, peer access: host work done before any launch or graph
// capture). Several processes: the prepare stage requests XLA's
// communicator of the groups; the initialize stage (outside capture, with
// the communicator acquired) opens this device's channel once: its block,
// the all-gather of the group's IPC handles, the mapping of the peers'
// blocks. Where XLA runs no initialize stage, the first execution opens it,
// and refuses to inside a CUDA graph capture. The execute stage finds this
// device's group and rank and enqueues kernels only (command-buffer
// compatible).
#include "nvlink_handlers.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <cuda_runtime_api.h>

#include "collectives_ext.h"
#include "nvlink_channel.h"
#include "nvlink_registry.h"
#include "replica_groups.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_checks.h"
#ifdef MOE_JAX_WITH_NCCL
#include "nvlink_exchange.h"
#endif

namespace ffi = xla::ffi;

namespace moe_jax::cuda::nvlink {

struct Attrs {
  ffi::Span<const int64_t> device_ordinals;
  int64_t group_size, experts_per_rank, tokens, top_k, row_bytes, dispatch_fp8, multi_process;
  ffi::Span<const int64_t> replica_groups;
};

}  // namespace moe_jax::cuda::nvlink

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    moe_jax::cuda::nvlink::Attrs,
    xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("device_ordinals"),
    xla::ffi::StructMember<int64_t>("group_size"),
    xla::ffi::StructMember<int64_t>("experts_per_rank"),
    xla::ffi::StructMember<int64_t>("tokens"), xla::ffi::StructMember<int64_t>("top_k"),
    xla::ffi::StructMember<int64_t>("row_bytes"),
    xla::ffi::StructMember<int64_t>("dispatch_fp8"),
    xla::ffi::StructMember<int64_t>("multi_process"),
    xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("replica_groups"));

namespace moe_jax::cuda::nvlink {
namespace {

constexpr std::string_view kName = "moe_jax_nvlink";
using Ret = ffi::Result<ffi::AnyBuffer>;
using MaybeCollectives = std::optional<CollectivesContext>;

// Where an execute handler runs: XLA's stream, this GPU, and XLA's
// collectives extension if attached (multi-process meshes need it).
struct Site {
  cudaStream_t stream;
  int32_t device;
  const MaybeCollectives& collectives;
};

ffi::Error ShapeOf(const Attrs& a, ChannelShape* shape) {
  if (a.group_size < 1 || a.group_size > kMaxRanks) {
    return Invalid(kName, "attribute `group_size` must be in [1, " + std::to_string(kMaxRanks) +
                              "] (one NVLink domain), got " + std::to_string(a.group_size));
  }
  if (a.device_ordinals.size() == 0 || a.device_ordinals.size() % a.group_size != 0) {
    return Invalid(kName, "attribute `device_ordinals` must hold G * group_size ids, got " +
                              std::to_string(a.device_ordinals.size()));
  }
  if (a.experts_per_rank < 1 || a.experts_per_rank > kMaxLocalExperts ||
      a.group_size * a.experts_per_rank > kMaxExperts) {
    return Invalid(
        kName, "attribute `experts_per_rank` must be in [1, " + std::to_string(kMaxLocalExperts) +
                   "] with group_size * experts_per_rank <= " + std::to_string(kMaxExperts) +
                   ", got " + std::to_string(a.experts_per_rank));
  }
  if (a.tokens < 1 || a.top_k < 1 || a.tokens * a.top_k > (int64_t{1} << 30)) {
    return Invalid(kName,
                   "attributes `tokens` and `top_k` must be >= 1 with tokens * top_k < 2^30, got " +
                       std::to_string(a.tokens) + " and " + std::to_string(a.top_k));
  }
  if (a.row_bytes < 16 || a.row_bytes % 16 != 0) {
    return Invalid(kName,
                   "attribute `row_bytes` (H * itemsize) must be a positive multiple of 16, got " +
                       std::to_string(a.row_bytes));
  }
  if (a.dispatch_fp8 != 0 && (a.dispatch_fp8 != 1 || a.row_bytes % 1024 != 0)) {
    return Invalid(kName,
                   "attribute `dispatch_fp8` must be 0 or 1, and 1 needs bf16 rows with H a "
                   "multiple of 512 (row_bytes a multiple of 1024), got dispatch_fp8=" +
                       std::to_string(a.dispatch_fp8) +
                       ", row_bytes=" + std::to_string(a.row_bytes));
  }
  if (a.multi_process != 0 &&
      (a.multi_process != 1 || a.replica_groups.size() != a.device_ordinals.size())) {
    return Invalid(kName,
                   "attribute `multi_process` must be 0 or 1, and 1 needs `replica_groups` of "
                   "G * group_size ids like `device_ordinals`, got multi_process=" +
                       std::to_string(a.multi_process) + " with " +
                       std::to_string(a.replica_groups.size()) + " replica group ids");
  }
  const int64_t vectors_per_row = a.row_bytes / 16;
  const int64_t per_source = a.tokens * std::min(a.top_k, a.experts_per_rank);
  if (a.tokens * a.top_k * vectors_per_row >= (int64_t{1} << 31) ||
      a.group_size * per_source * vectors_per_row >= (int64_t{1} << 31)) {
    return Invalid(kName,
                   "tokens * top_k * H * itemsize / 16 and P * tokens * min(top_k, "
                   "experts_per_rank) * H * itemsize / 16 must stay below 2^31");
  }
  shape->num_ranks = static_cast<int32_t>(a.group_size);
  shape->experts_per_rank = static_cast<int32_t>(a.experts_per_rank);
  shape->tokens = a.tokens;
  shape->top_k = static_cast<int32_t>(a.top_k);
  shape->row_bytes = a.row_bytes;
  shape->dispatch_fp8 = static_cast<int32_t>(a.dispatch_fp8);
  return ffi::Error::Success();
}

std::vector<int> Group(const Attrs& a, size_t g) {
  std::vector<int> ordinals;
  for (int64_t r = 0; r < a.group_size; ++r) {
    ordinals.push_back(static_cast<int>(a.device_ordinals[g * a.group_size + r]));
  }
  return ordinals;
}

//===----------------------------------------------------------------------===//
// Multi-process channels: XLA's communicator of the groups
//===----------------------------------------------------------------------===//

ffi::Error NeedCollectives(const MaybeCollectives& collectives, std::string_view stage) {
  if (collectives.has_value()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    std::string(kName) + ": the mesh spans processes, which needs XLA's "
                    "communicator, but XLA attached no collectives extension to the " +
                    std::string(stage) + " stage");
}

ffi::Error RequestCommunicator(const Attrs& a, const MaybeCollectives& collectives) {
  if (ffi::Error err = NeedCollectives(collectives, "prepare"); err.failure()) return err;
  ffi::ErrorOr<const ReplicaGroups*> groups =
      ParseReplicaGroups(a.replica_groups, a.group_size, kName);
  if (!groups.has_value()) return groups.error();
  return collectives->RequestFlattened((*groups)->views, /*communication_id=*/0, kName);
}

ffi::ErrorOr<void*> Communicator(const Attrs& a, const MaybeCollectives& collectives,
                                 std::string_view stage) {
  if (ffi::Error err = NeedCollectives(collectives, stage); err.failure()) return err;
  ffi::ErrorOr<const ReplicaGroups*> groups =
      ParseReplicaGroups(a.replica_groups, a.group_size, kName);
  if (!groups.has_value()) return groups.error();
  ffi::ErrorOr<XLA_FFI_Communicator*> comm =
      collectives->GetFlattened((*groups)->views, /*communication_id=*/0, kName);
  if (!comm.has_value()) return comm.error();
  return static_cast<void*>(*comm);
}

ffi::Error NotCapturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaError_t err = cudaStreamIsCapturing(stream, &status); err != cudaSuccess) {
    return Internal(kName, "cudaStreamIsCapturing failed: " + CudaErrorText(err));
  }
  if (status == cudaStreamCaptureStatusNone) return ffi::Error::Success();
  return ffi::Error(
      ffi::ErrorCode::kFailedPrecondition,
      std::string(kName) + ": the channel's CUDA IPC handles must be exchanged once, outside "
      "CUDA graph capture, but its first use is being captured (XLA ran no initialize stage "
      "for this call). Run a program with the same NVLink dispatch shapes once without "
      "command buffers first, or keep custom calls out of them (XLA_FLAGS="
      "--xla_gpu_enable_command_buffer= without CUSTOM_CALL)");
}

// Opens (once) or finds this device's channel in a multi-process mesh.
// `stream`: XLA's stream in the execute stage (checked for capture before a
// first use), nullptr in the initialize stage.
ffi::Error SharedView(const Attrs& a, const ChannelShape& shape, int32_t device,
                      const MaybeCollectives& collectives, cudaStream_t stream,
                      std::string_view stage, ChannelView* view) {
  ffi::ErrorOr<void*> comm = Communicator(a, collectives, stage);
  if (!comm.has_value()) return comm.error();
  if (const ChannelView* found = FindSharedChannel(*comm, device, shape)) {
    *view = *found;
    return ffi::Error::Success();
  }
  if (stream != nullptr) {
    if (ffi::Error err = NotCapturing(stream); err.failure()) return err;
  }
#ifdef MOE_JAX_WITH_NCCL
  int rank = -1, count = 0;
  std::string error;
  if (!CommRankAndCount(*comm, &rank, &count, &error)) return ffi::Error::Internal(error);
  if (count != a.group_size || rank < 0 || rank >= count) {
    return ffi::Error::Internal(std::string(kName) + ": XLA's communicator has rank " +
                                std::to_string(rank) + " of " + std::to_string(count) +
                                " but group_size is " + std::to_string(a.group_size));
  }
  const GatherRecords gather = [&](const PeerRecord& mine, std::vector<PeerRecord>* all,
                                   std::string* err) {
    all->resize(static_cast<size_t>(count));
    return AllGatherHostBytes(*comm, &mine, all->data(), sizeof(PeerRecord), count, err);
  };
  const ChannelView* opened = OpenSharedChannel(*comm, device, rank, shape, gather, &error);
  if (opened == nullptr) {
    return ffi::Error::Internal(std::string(kName) + ": opening the channel of GPU " +
                                std::to_string(device) + " (rank " + std::to_string(rank) +
                                "): " + error);
  }
  *view = *opened;
  return ffi::Error::Success();
#else
  return Invalid(kName,
                 "this build has no NCCL (nccl.h was not found at build time), which a mesh "
                 "spanning processes needs for the handle exchange");
#endif
}

//===----------------------------------------------------------------------===//
// Stages
//===----------------------------------------------------------------------===//

ffi::Error PrepareImpl(MaybeCollectives collectives, Attrs a) {
  ChannelShape shape;
  if (ffi::Error err = ShapeOf(a, &shape); err.failure()) return err;
  if (a.multi_process) return RequestCommunicator(a, collectives);
  for (size_t g = 0; g * a.group_size < a.device_ordinals.size(); ++g) {
    std::string error;
    if (GetChannel(Group(a, g), shape, &error) == nullptr) return Invalid(kName, error);
  }
  return ffi::Error::Success();
}

// Multi-process: opens this device's channel outside any capture. One
// process: nothing (the prepare stage created the channels).
ffi::Error InitializeImpl(int32_t device, MaybeCollectives collectives, Attrs a) {
  if (!a.multi_process) return ffi::Error::Success();
  ChannelShape shape;
  if (ffi::Error err = ShapeOf(a, &shape); err.failure()) return err;
  ChannelView view;
  return SharedView(a, shape, device, collectives, /*stream=*/nullptr, "initialize", &view);
}

// The kernels' view of this device's channel (its group and rank).
ffi::Error Find(const Attrs& a, const Site& site, ChannelView* view) {
  ChannelShape shape;
  if (ffi::Error err = ShapeOf(a, &shape); err.failure()) return err;
  if (a.multi_process) {
    return SharedView(a, shape, site.device, site.collectives, site.stream, "execute", view);
  }
  const int32_t device = site.device;
  for (size_t i = 0; i < a.device_ordinals.size(); ++i) {
    if (a.device_ordinals[i] != device) continue;
    std::vector<int> group = Group(a, i / a.group_size);
    const Channel* channel = FindChannel(group, shape);
    if (channel == nullptr) {
      std::string error;
      channel = GetChannel(group, shape, &error);
      if (channel == nullptr) return Invalid(kName, error);
    }
    *view = channel->ViewFrom(static_cast<int>(i % a.group_size));
    return ffi::Error::Success();
  }
  return Invalid(kName, "GPU " + std::to_string(device) +
                            " is not in attribute `device_ordinals` (the devices of the mesh)");
}

ffi::Error Launched(std::string_view call, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  const std::string target = std::string(kName) + "_" + std::string(call);
  return Internal(CustomCall(target), "kernel launch failed: " + CudaErrorText(err));
}

// INVALID_ARGUMENT "moe_jax_nvlink: <half>: <kind> `<name>` must be <want>,
// got <got>" unless `ok`.
ffi::Error Need(bool ok, std::string_view half, std::string_view kind, std::string_view name,
                const std::string& want, const ffi::AnyBuffer& got) {
  if (ok) return ffi::Error::Success();
  const std::string call = Prefixed(kName, half);
  return Mismatch(CustomCall(call), kind, name, want, got);
}

// What each half's kernels take, once its buffers are checked.
struct DispatchSendArgs {
  const void* x;
  const int32_t* expert_ids;
  int32_t* slot_pos;
  int32_t* send_counts;
};
struct DispatchRecvArgs {
  void* rows;
  float* scales;
  int32_t* group_sizes;
  int32_t* all_counts;
};
struct CombineSendArgs {
  const void* y;
  const int32_t* all_counts;
};
struct CombineRecvArgs {
  ElemType type;
  const int32_t* expert_ids;
  const int32_t* slot_pos;
  const float* weights;
  void* out;
};

ffi::Error CheckDispatchSend(const ChannelView& ch, ffi::AnyBuffer x,
                             ffi::AnyBuffer expert_ids, Ret slot_pos, Ret send_counts,
                             const Attrs& a, DispatchSendArgs* args) {
  const std::optional<ElemType> type = ToFloatType(x.element_type());
  const bool fp8 = ch.shape.dispatch_fp8 != 0;
  if (auto e = Need(type && (!fp8 || *type == ElemType::kBF16) &&
                        HasDims(x, {a.tokens, a.row_bytes / ElemBytes(*type)}),
                    "dispatch_send", "operand", "x",
                    std::string(fp8 ? "bf16" : "f32/bf16/f16") +
                        " [tokens, row_bytes / itemsize]",
                    x);
      e.failure()) {
    return e;
  }
  if (auto e = Need(expert_ids.element_type() == ffi::DataType::S32 &&
                        HasDims(expert_ids, {a.tokens, a.top_k}),
                    "dispatch_send", "operand", "expert_ids", Shape("s32", {a.tokens, a.top_k}),
                    expert_ids);
      e.failure()) {
    return e;
  }
  *args = {x.untyped_data(), static_cast<const int32_t*>(expert_ids.untyped_data()),
           static_cast<int32_t*>(slot_pos->untyped_data()),
           static_cast<int32_t*>(send_counts->untyped_data())};
  return ffi::Error::Success();
}

// scales: nullptr unless the channel dispatches fp8.
ffi::Error CheckDispatchRecv(const ChannelView& ch, Ret rows, Ret* scales,
                             Ret group_sizes, Ret all_counts, const Attrs& a,
                             DispatchRecvArgs* args) {
  const ChannelShape& s = ch.shape;
  const int64_t want_rows = a.group_size * s.RowsPerSource();
  const bool fp8 = s.dispatch_fp8 != 0;
  if (fp8 != (scales != nullptr)) {
    return Invalid(kName, std::string("dispatch_recv: the channel ") +
                              (fp8 ? "dispatches fp8 (dispatch_fp8=1): call the _fp8 target"
                                   : "does not dispatch fp8: call the target without _fp8"));
  }
  const std::optional<ElemType> type = ToFloatType(rows->element_type());
  const bool rows_ok = fp8 ? rows->element_type() == ffi::DataType::F8E4M3FN &&
                                 HasDims(*rows, {want_rows, s.Hidden()})
                           : type && HasDims(*rows, {want_rows, a.row_bytes / ElemBytes(*type)});
  if (auto e = Need(rows_ok, "dispatch_recv", "result", "rows",
                    std::string(fp8 ? "f8e4m3fn" : "") +
                        "[P * tokens * min(top_k, experts_per_rank) = " +
                        std::to_string(want_rows) + ", H]",
                    *rows);
      e.failure()) {
    return e;
  }
  if (fp8) {
    if (auto e = Need((*scales)->element_type() == ffi::DataType::F32 &&
                          HasDims(**scales, {want_rows, s.Hidden() / 128}),
                      "dispatch_recv", "result", "scales",
                      Shape("f32", {want_rows, s.Hidden() / 128}), **scales);
        e.failure()) {
      return e;
    }
  }
  *args = {rows->untyped_data(),
           fp8 ? static_cast<float*>((*scales)->untyped_data()) : nullptr,
           static_cast<int32_t*>(group_sizes->untyped_data()),
           static_cast<int32_t*>(all_counts->untyped_data())};
  return ffi::Error::Success();
}

ffi::Error CheckCombineSend(const ChannelView& ch, ffi::AnyBuffer y,
                            ffi::AnyBuffer all_counts, const Attrs& a, CombineSendArgs* args) {
  const int64_t want_rows = a.group_size * ch.shape.RowsPerSource();
  const std::optional<ElemType> type = ToFloatType(y.element_type());
  if (auto e = Need(type && HasDims(y, {want_rows, a.row_bytes / ElemBytes(*type)}),
                    "combine_send", "operand", "y",
                    "[" + std::to_string(want_rows) + ", H] in x's dtype", y);
      e.failure()) {
    return e;
  }
  const int64_t p = a.group_size;
  if (auto e = Need(all_counts.element_type() == ffi::DataType::S32 &&
                        HasDims(all_counts, {p, p, a.experts_per_rank}),
                    "combine_send", "operand", "all_counts",
                    Shape("s32", {p, p, a.experts_per_rank}), all_counts);
      e.failure()) {
    return e;
  }
  *args = {y.untyped_data(), static_cast<const int32_t*>(all_counts.untyped_data())};
  return ffi::Error::Success();
}

ffi::Error CheckCombineRecv(ffi::AnyBuffer expert_ids, ffi::AnyBuffer slot_pos,
                            ffi::AnyBuffer weights, Ret out, const Attrs& a,
                            CombineRecvArgs* args) {
  const std::optional<ElemType> type = ToFloatType(out->element_type());
  if (auto e = Need(type && HasDims(*out, {a.tokens, a.row_bytes / ElemBytes(*type)}),
                    "combine_recv", "result", "out", "[tokens, H] in x's dtype", *out);
      e.failure()) {
    return e;
  }
  for (auto [name, buf, dtype] :
       {std::tuple{"expert_ids", &expert_ids, ffi::DataType::S32},
        std::tuple{"slot_pos", &slot_pos, ffi::DataType::S32},
        std::tuple{"weights", &weights, ffi::DataType::F32}}) {
    if (auto e = Need(buf->element_type() == dtype && HasDims(*buf, {a.tokens, a.top_k}),
                      "combine_recv", "operand", name,
                      Shape(DTypeName(dtype), {a.tokens, a.top_k}), *buf);
        e.failure()) {
      return e;
    }
  }
  *args = {*type, static_cast<const int32_t*>(expert_ids.untyped_data()),
           static_cast<const int32_t*>(slot_pos.untyped_data()),
           static_cast<const float*>(weights.untyped_data()), out->untyped_data()};
  return ffi::Error::Success();
}

// The execute handlers. Fused calls run both halves (in one kernel where
// the shape allows): nothing XLA schedules can come between them, so
// consecutive calls of a channel always alternate send and receive.

ffi::Error DispatchSendImpl(cudaStream_t stream, int32_t device, MaybeCollectives collectives,
                            ffi::AnyBuffer x, ffi::AnyBuffer expert_ids, Ret slot_pos,
                            Ret send_counts, Attrs a) {
  ChannelView ch;
  DispatchSendArgs s;
  if (ffi::Error e = Find(a, Site{stream, device, collectives}, &ch); e.failure()) return e;
  if (ffi::Error e = CheckDispatchSend(ch, x, expert_ids, slot_pos, send_counts, a, &s);
      e.failure()) {
    return e;
  }
  return Launched("dispatch_send", LaunchDispatchSend(ch, s.x, s.expert_ids, s.slot_pos,
                                                      s.send_counts, stream));
}

// scales: nullptr unless the channel dispatches fp8.
ffi::Error DispatchRecvAny(cudaStream_t stream, int32_t device, MaybeCollectives collectives,
                           Ret rows, Ret* scales, Ret group_sizes, Ret all_counts,
                           const Attrs& a) {
  ChannelView ch;
  DispatchRecvArgs r;
  if (ffi::Error e = Find(a, Site{stream, device, collectives}, &ch); e.failure()) return e;
  if (ffi::Error e = CheckDispatchRecv(ch, rows, scales, group_sizes, all_counts, a, &r);
      e.failure()) {
    return e;
  }
  return Launched("dispatch_recv", LaunchDispatchRecv(ch, r.rows, r.scales, r.group_sizes,
                                                      r.all_counts, stream));
}

ffi::Error DispatchRecvImpl(cudaStream_t stream, int32_t device, MaybeCollectives collectives,
                            ffi::AnyBuffer /*slot_pos*/, Ret rows, Ret group_sizes,
                            Ret all_counts, Attrs a) {
  return DispatchRecvAny(stream, device, collectives, rows, nullptr, group_sizes, all_counts, a);
}

ffi::Error DispatchRecvFp8Impl(cudaStream_t stream, int32_t device,
                               MaybeCollectives collectives, ffi::AnyBuffer /*slot_pos*/,
                               Ret rows, Ret scales, Ret group_sizes, Ret all_counts, Attrs a) {
  return DispatchRecvAny(stream, device, collectives, rows, &scales, group_sizes, all_counts, a);
}

ffi::Error DispatchAny(cudaStream_t stream, int32_t device, MaybeCollectives collectives,
                       ffi::AnyBuffer x, ffi::AnyBuffer expert_ids, Ret slot_pos,
                       Ret send_counts, Ret rows, Ret* scales, Ret group_sizes, Ret all_counts,
                       const Attrs& a) {
  ChannelView ch;
  DispatchSendArgs s;
  DispatchRecvArgs r;
  if (ffi::Error e = Find(a, Site{stream, device, collectives}, &ch); e.failure()) return e;
  if (ffi::Error e = CheckDispatchSend(ch, x, expert_ids, slot_pos, send_counts, a, &s);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckDispatchRecv(ch, rows, scales, group_sizes, all_counts, a, &r);
      e.failure()) {
    return e;
  }
  return Launched("dispatch", LaunchDispatch(ch, s.x, s.expert_ids, s.slot_pos, s.send_counts,
                                             r.rows, r.scales, r.group_sizes, r.all_counts,
                                             stream));
}

ffi::Error DispatchImpl(cudaStream_t stream, int32_t device, MaybeCollectives collectives,
                        ffi::AnyBuffer x, ffi::AnyBuffer expert_ids, Ret slot_pos,
                        Ret send_counts, Ret rows, Ret group_sizes, Ret all_counts, Attrs a) {
  return DispatchAny(stream, device, collectives, x, expert_ids, slot_pos, send_counts, rows,
                     nullptr, group_sizes, all_counts, a);
}

ffi::Error DispatchFp8Impl(cudaStream_t stream, int32_t device, MaybeCollectives collectives,
                           ffi::AnyBuffer x, ffi::AnyBuffer expert_ids, Ret slot_pos,
                           Ret send_counts, Ret rows, Ret scales, Ret group_sizes,
                           Ret all_counts, Attrs a) {
  return DispatchAny(stream, device, collectives, x, expert_ids, slot_pos, send_counts, rows,
                     &scales, group_sizes, all_counts, a);
}

ffi::Error CombineSendImpl(cudaStream_t stream, int32_t device, MaybeCollectives collectives,
                           ffi::AnyBuffer y, ffi::AnyBuffer all_counts, Ret /*done*/, Attrs a) {
  ChannelView ch;
  CombineSendArgs s;
  if (ffi::Error e = Find(a, Site{stream, device, collectives}, &ch); e.failure()) return e;
  if (ffi::Error e = CheckCombineSend(ch, y, all_counts, a, &s); e.failure()) return e;
  return Launched("combine_send", LaunchCombineSend(ch, s.y, s.all_counts, stream));
}

ffi::Error CombineRecvImpl(cudaStream_t stream, int32_t device, MaybeCollectives collectives,
                           ffi::AnyBuffer /*done*/, ffi::AnyBuffer expert_ids,
                           ffi::AnyBuffer slot_pos, ffi::AnyBuffer weights, Ret out, Attrs a) {
  ChannelView ch;
  CombineRecvArgs r;
  if (ffi::Error e = Find(a, Site{stream, device, collectives}, &ch); e.failure()) return e;
  if (ffi::Error e = CheckCombineRecv(expert_ids, slot_pos, weights, out, a, &r); e.failure()) {
    return e;
  }
  return Launched("combine_recv", LaunchCombineRecv(ch, r.type, r.expert_ids, r.slot_pos,
                                                    r.weights, r.out, stream));
}

ffi::Error CombineImpl(cudaStream_t stream, int32_t device, MaybeCollectives collectives,
                       ffi::AnyBuffer y, ffi::AnyBuffer all_counts, ffi::AnyBuffer expert_ids,
                       ffi::AnyBuffer slot_pos, ffi::AnyBuffer weights, Ret out, Attrs a) {
  ChannelView ch;
  CombineSendArgs s;
  CombineRecvArgs r;
  if (ffi::Error e = Find(a, Site{stream, device, collectives}, &ch); e.failure()) return e;
  if (ffi::Error e = CheckCombineSend(ch, y, all_counts, a, &s); e.failure()) return e;
  if (ffi::Error e = CheckCombineRecv(expert_ids, slot_pos, weights, out, a, &r); e.failure()) {
    return e;
  }
  return Launched("combine", LaunchCombine(ch, r.type, s.y, s.all_counts, r.expert_ids,
                                           r.slot_pos, r.weights, r.out, stream));
}

// The execute binding's context: XLA's stream, this GPU's ordinal and the
// collectives extension if XLA attached it.
auto Execute() {
  return ffi::Ffi::BindExecute()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<OptionalCollectives>();
}

// Execute() then kArgs buffer operands, kRets buffer results and the
// attributes: every execute handler below takes its buffers in that order.
template <int kArgs, int kRets, class Binding>
auto WithBuffers(Binding binding) {
  if constexpr (kArgs > 0) {
    return WithBuffers<kArgs - 1, kRets>(std::move(binding).template Arg<ffi::AnyBuffer>());
  } else if constexpr (kRets > 0) {
    return WithBuffers<0, kRets - 1>(std::move(binding).template Ret<ffi::AnyBuffer>());
  } else {
    return std::move(binding).template Attrs<Attrs>();
  }
}

}  // namespace
}  // namespace moe_jax::cuda::nvlink

namespace nv = moe_jax::cuda::nvlink;

// The binding is parenthesized: its template arguments' comma must not
// split the macro's arguments.
#define MOE_JAX_NVLINK_EXECUTE_HANDLER(name, impl, args, rets)                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,                                     \
                                (nv::WithBuffers<args, rets>(nv::Execute())), \
                                {xla::ffi::Traits::kCmdBufferCompatible})

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeJaxNvlinkPrepare, nv::PrepareImpl,
                              xla::ffi::Ffi::BindPrepare()
                                  .Ctx<moe_jax::cuda::OptionalCollectives>()
                                  .Attrs<nv::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeJaxNvlinkInitialize, nv::InitializeImpl,
                              xla::ffi::Ffi::BindInitialize()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<moe_jax::cuda::OptionalCollectives>()
                                  .Attrs<nv::Attrs>());

// x, expert_ids -> slot_pos, send_counts
MOE_JAX_NVLINK_EXECUTE_HANDLER(MoeJaxNvlinkDispatchSend, nv::DispatchSendImpl, 2, 2);

// slot_pos (orders recv after send) -> rows, group_sizes, all_counts
MOE_JAX_NVLINK_EXECUTE_HANDLER(MoeJaxNvlinkDispatchRecv, nv::DispatchRecvImpl, 1, 3);

// slot_pos -> rows (f8e4m3fn), scales, group_sizes, all_counts
MOE_JAX_NVLINK_EXECUTE_HANDLER(MoeJaxNvlinkDispatchRecvFp8, nv::DispatchRecvFp8Impl, 1, 4);

// y, all_counts -> done (orders recv after send)
MOE_JAX_NVLINK_EXECUTE_HANDLER(MoeJaxNvlinkCombineSend, nv::CombineSendImpl, 2, 1);

// done, expert_ids, slot_pos, weights -> out
MOE_JAX_NVLINK_EXECUTE_HANDLER(MoeJaxNvlinkCombineRecv, nv::CombineRecvImpl, 4, 1);

// x, expert_ids -> slot_pos, send_counts, rows, group_sizes, all_counts
MOE_JAX_NVLINK_EXECUTE_HANDLER(MoeJaxNvlinkDispatch, nv::DispatchImpl, 2, 5);

// x (bf16), expert_ids -> slot_pos, send_counts, rows (f8e4m3fn), scales,
// group_sizes, all_counts
MOE_JAX_NVLINK_EXECUTE_HANDLER(MoeJaxNvlinkDispatchFp8, nv::DispatchFp8Impl, 2, 6);

// y, all_counts, expert_ids, slot_pos, weights -> out
MOE_JAX_NVLINK_EXECUTE_HANDLER(MoeJaxNvlinkCombine, nv::CombineImpl, 5, 1);


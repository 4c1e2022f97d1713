// Thin XLA FFI bindings: decode buffers and attributes, validate shapes and
// dtypes (naming the offending operand), call the plain C++ kernels.
#include "xla_ffi/handlers_cpu.h"

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/all_to_all_cpu.h"
#include "xla_ffi/combine_cpu.h"
#include "xla_ffi/ffi_checks.h"
#include "xla_ffi/pack_cpu.h"
#include "xla_ffi/rendezvous.h"

namespace moe_jax {
namespace {

namespace ffi = ::xla::ffi;
using ffi_checks::Bad;
using ffi_checks::BadAttr;
using ffi_checks::BadResult;
using ffi_checks::CustomCall;
using ffi_checks::Dims;
using ffi_checks::HasDims;
using ffi_checks::Invalid;
using ffi_checks::IsS32;
using ffi_checks::Spelling;
using ffi_checks::ToFloatType;

constexpr CustomCall kPack{"moe_jax_pack", Spelling::kCpu};
constexpr CustomCall kCombine{"moe_jax_combine", Spelling::kCpu};
constexpr CustomCall kAllToAll{"moe_jax_all_to_all", Spelling::kCpu};

// ---------------------------------------------------------------------------
// moe_jax_pack(x, sorted_slots, send_offsets, send_counts;
//              top_k, start, capacity, spill_capacity) -> (cap_buf, spill_buf)

ffi::Error PackImpl(ffi::AnyBuffer x, ffi::AnyBuffer sorted_slots,
                    ffi::AnyBuffer send_offsets, ffi::AnyBuffer send_counts,
                    int64_t top_k, int64_t start, int64_t capacity,
                    int64_t spill_capacity,
                    ffi::Result<ffi::AnyBuffer> cap_buf,
                    ffi::Result<ffi::AnyBuffer> spill_buf) {
  const auto xt = ToFloatType(x.element_type());
  if (!xt || x.dimensions().size() != 2) {
    return Bad(kPack, "x", "f32, bf16 or f16 of shape [T, H]", x);
  }
  const int64_t T = x.dimensions()[0], H = x.dimensions()[1];
  if (top_k < 1) return BadAttr(kPack, "top_k", top_k, ">= 1");
  if (start < 0) return BadAttr(kPack, "start", start, ">= 0");
  if (capacity < 0) return BadAttr(kPack, "capacity", capacity, ">= 0");
  if (spill_capacity < 0) {
    return BadAttr(kPack, "spill_capacity", spill_capacity, ">= 0");
  }
  const auto ss = sorted_slots.dimensions();
  if (sorted_slots.element_type() != ffi::DataType::S32 || ss.size() != 1 ||
      ss[0] % top_k != 0 || ss[0] / top_k != T) {
    return Bad(kPack, "sorted_slots",
               "int32 of shape [N] with N = T * top_k = " + std::to_string(T) +
                   " * " + std::to_string(top_k),
               sorted_slots);
  }
  if (send_offsets.element_type() != ffi::DataType::S32 ||
      send_offsets.dimensions().size() != 1) {
    return Bad(kPack, "send_offsets", "int32 of shape [P]", send_offsets);
  }
  const int64_t P = send_offsets.dimensions()[0];
  if (!IsS32(send_counts, {P})) {
    return Bad(kPack, "send_counts", "int32 of shape [P] = " + Dims({P}),
               send_counts);
  }
  if (cap_buf->element_type() != x.element_type() ||
      !HasDims(*cap_buf, {P, capacity, H})) {
    return BadResult(
        kPack, "cap_buf",
        "of x's dtype and shape [P, capacity, H] = " + Dims({P, capacity, H}),
        *cap_buf);
  }
  if (spill_buf->element_type() != x.element_type() ||
      !HasDims(*spill_buf, {P, spill_capacity, H})) {
    return BadResult(kPack, "spill_buf",
                     "of x's dtype and shape [P, spill_capacity, H] = " +
                         Dims({P, spill_capacity, H}),
                     *spill_buf);
  }
  cpu::PackArgs a;
  a.x = x.untyped_data();
  a.num_tokens = T;
  a.row_bytes = H * FloatTypeBytes(*xt);
  a.sorted_slots = static_cast<const int32_t*>(sorted_slots.untyped_data());
  a.send_offsets = static_cast<const int32_t*>(send_offsets.untyped_data());
  a.send_counts = static_cast<const int32_t*>(send_counts.untyped_data());
  a.num_ranks = P;
  a.top_k = top_k;
  a.start = start;
  a.capacity = capacity;
  a.spill_capacity = spill_capacity;
  a.cap_buf = cap_buf->untyped_data();
  a.spill_buf = spill_buf->untyped_data();
  const std::string err = cpu::Pack(a);
  if (!err.empty()) return Invalid(kPack, err);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// moe_jax_combine(cap_ret, spill_ret, dest, pos, weights; start) -> out

ffi::Error CombineImpl(ffi::AnyBuffer cap_ret, ffi::AnyBuffer spill_ret,
                       ffi::AnyBuffer dest, ffi::AnyBuffer pos,
                       ffi::AnyBuffer weights, int64_t start,
                       ffi::Result<ffi::AnyBuffer> out) {
  const auto in_t = ToFloatType(cap_ret.element_type());
  if (!in_t || cap_ret.dimensions().size() != 3) {
    return Bad(kCombine, "cap_ret", "f32, bf16 or f16 of shape [P, C, H]",
               cap_ret);
  }
  const int64_t P = cap_ret.dimensions()[0], C = cap_ret.dimensions()[1],
                H = cap_ret.dimensions()[2];
  const auto sd = spill_ret.dimensions();
  if (spill_ret.element_type() != cap_ret.element_type() || sd.size() != 3 ||
      sd[0] != P || sd[2] != H) {
    return Bad(kCombine, "spill_ret",
               "of cap_ret's dtype and shape [P, S, H] with P = " +
                   std::to_string(P) + ", H = " + std::to_string(H),
               spill_ret);
  }
  const int64_t S = sd[1];
  if (weights.element_type() != ffi::DataType::F32 ||
      weights.dimensions().size() != 2 || weights.dimensions()[1] < 1) {
    return Bad(kCombine, "weights", "f32 of shape [T, k] with k >= 1", weights);
  }
  const int64_t T = weights.dimensions()[0], k = weights.dimensions()[1];
  if (!IsS32(dest, {T * k})) {
    return Bad(kCombine, "dest",
               "int32 of shape [N] = [T * k] = " + Dims({T * k}), dest);
  }
  if (!IsS32(pos, {T * k})) {
    return Bad(kCombine, "pos",
               "int32 of shape [N] = [T * k] = " + Dims({T * k}), pos);
  }
  const auto out_t = ToFloatType(out->element_type());
  if (!out_t || !HasDims(*out, {T, H})) {
    return BadResult(kCombine, "out",
                     "f32, bf16 or f16 of shape [T, H] = " + Dims({T, H}),
                     *out);
  }
  if (start < 0) return BadAttr(kCombine, "start", start, ">= 0");
  cpu::CombineArgs a;
  a.in_type = *in_t;
  a.out_type = *out_t;
  a.cap_ret = cap_ret.untyped_data();
  a.spill_ret = spill_ret.untyped_data();
  a.num_ranks = P;
  a.capacity = C;
  a.spill_capacity = S;
  a.hidden = H;
  a.dest = static_cast<const int32_t*>(dest.untyped_data());
  a.pos = static_cast<const int32_t*>(pos.untyped_data());
  a.weights = static_cast<const float*>(weights.untyped_data());
  a.num_tokens = T;
  a.top_k = k;
  a.start = start;
  a.out = out->untyped_data();
  const std::string err = cpu::Combine(a);
  if (!err.empty()) return Invalid(kCombine, err);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// moe_jax_all_to_all(send, send_offsets, send_sizes, recv_offsets, rank,
//                    group; channel_id) -> (recv, recv_sizes)

ffi::Error AllToAllImpl(ffi::RunId run_id, int32_t device_ordinal,
                        ffi::AnyBuffer send, ffi::AnyBuffer send_offsets,
                        ffi::AnyBuffer send_sizes, ffi::AnyBuffer recv_offsets,
                        ffi::AnyBuffer rank, ffi::AnyBuffer group,
                        int64_t channel_id, ffi::Result<ffi::AnyBuffer> recv,
                        ffi::Result<ffi::AnyBuffer> recv_sizes) {
  const auto send_dims = send.dimensions();
  const size_t elem_bytes = ffi::ByteWidth(send.element_type());
  if (send_dims.size() < 1 || elem_bytes == 0) {
    return Bad(kAllToAll, "send", "an array of rank >= 1 ([Ns, ...])", send);
  }
  if (send_sizes.element_type() != ffi::DataType::S32 ||
      send_sizes.dimensions().size() != 1 || send_sizes.dimensions()[0] < 1) {
    return Bad(kAllToAll, "send_sizes", "int32 of shape [P] with P >= 1",
               send_sizes);
  }
  const int64_t P = send_sizes.dimensions()[0];
  if (!IsS32(send_offsets, {P})) {
    return Bad(kAllToAll, "send_offsets", "int32 of shape [P] = " + Dims({P}),
               send_offsets);
  }
  if (!IsS32(recv_offsets, {P})) {
    return Bad(kAllToAll, "recv_offsets", "int32 of shape [P] = " + Dims({P}),
               recv_offsets);
  }
  if (!IsS32(rank, {})) {
    return Bad(kAllToAll, "rank", "an int32 scalar (shape [])", rank);
  }
  if (!IsS32(group, {})) {
    return Bad(kAllToAll, "group", "an int32 scalar (shape [])", group);
  }
  const auto recv_dims = recv->dimensions();
  bool recv_ok = recv->element_type() == send.element_type() &&
                 recv_dims.size() == send_dims.size();
  for (size_t i = 1; recv_ok && i < send_dims.size(); ++i) {
    recv_ok = recv_dims[i] == send_dims[i];
  }
  if (!recv_ok) {
    return BadResult(kAllToAll, "recv",
                     "of send's dtype and row shape ([Nr, ...] with send = " +
                         ffi_checks::Describe(send, Spelling::kCpu) + ")",
                     *recv);
  }
  if (!IsS32(*recv_sizes, {P})) {
    return BadResult(kAllToAll, "recv_sizes",
                     "int32 of shape [P] = " + Dims({P}), *recv_sizes);
  }
  int64_t row_elems = 1;
  for (size_t i = 1; i < send_dims.size(); ++i) row_elems *= send_dims[i];
  const std::string dtype_name(ffi_checks::DTypeName(send.element_type()));

  cpu::AllToAllArgs a;
  a.key.run_id = run_id.run_id;
  a.key.channel_id = channel_id;
  a.key.group_key = *static_cast<const int32_t*>(group.untyped_data());
  a.device = device_ordinal;
  a.rank = *static_cast<const int32_t*>(rank.untyped_data());
  a.num_ranks = static_cast<int32_t>(P);
  a.send = send.untyped_data();
  a.send_rows = send_dims[0];
  a.row_bytes = row_elems * static_cast<int64_t>(elem_bytes);
  a.dtype = static_cast<int32_t>(send.element_type());
  a.dtype_name = dtype_name.c_str();
  a.row_dims = send_dims.begin() + 1;
  a.row_rank = static_cast<int64_t>(send_dims.size()) - 1;
  a.send_offsets = static_cast<const int32_t*>(send_offsets.untyped_data());
  a.send_sizes = static_cast<const int32_t*>(send_sizes.untyped_data());
  a.recv_offsets = static_cast<const int32_t*>(recv_offsets.untyped_data());
  a.recv = recv->untyped_data();
  a.recv_rows = recv_dims[0];
  a.recv_sizes = static_cast<int32_t*>(recv_sizes->untyped_data());
  const std::string err = cpu::AllToAll(a, cpu::AllToAllTimeoutFromEnv(),
                                        cpu::GlobalAllToAllRendezvous());
  if (!err.empty()) return Invalid(kAllToAll, err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeJaxPackCpu, moe_jax::PackImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // sorted_slots
                                  .Arg<xla::ffi::AnyBuffer>()  // send_offsets
                                  .Arg<xla::ffi::AnyBuffer>()  // send_counts
                                  .Attr<int64_t>("top_k")
                                  .Attr<int64_t>("start")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("spill_capacity")
                                  .Ret<xla::ffi::AnyBuffer>()   // cap_buf
                                  .Ret<xla::ffi::AnyBuffer>());  // spill_buf

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeJaxCombineCpu, moe_jax::CombineImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // cap_ret
                                  .Arg<xla::ffi::AnyBuffer>()  // spill_ret
                                  .Arg<xla::ffi::AnyBuffer>()  // dest
                                  .Arg<xla::ffi::AnyBuffer>()  // pos
                                  .Arg<xla::ffi::AnyBuffer>()  // weights
                                  .Attr<int64_t>("start")
                                  .Ret<xla::ffi::AnyBuffer>());  // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeJaxAllToAllCpu, moe_jax::AllToAllImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::RunId>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()  // send
                                  .Arg<xla::ffi::AnyBuffer>()  // send_offsets
                                  .Arg<xla::ffi::AnyBuffer>()  // send_sizes
                                  .Arg<xla::ffi::AnyBuffer>()  // recv_offsets
                                  .Arg<xla::ffi::AnyBuffer>()  // rank
                                  .Arg<xla::ffi::AnyBuffer>()  // group
                                  .Attr<int64_t>("channel_id")
                                  .Ret<xla::ffi::AnyBuffer>()   // recv
                                  .Ret<xla::ffi::AnyBuffer>());  // recv_sizes

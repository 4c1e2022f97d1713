// moe_jax_nccl_all_to_all on CUDA: an all-to-all of n >= 1 buffers through
// XLA's own NCCL communicator, obtained from the FFI collectives extension.
//
//   operands  x_0..x_{n-1}: [P, C_i, ...] any dtype (byte-sized elements)
//   results   y_0..y_{n-1}: same shapes and dtypes
//   attrs     replica_groups: i64[G * P], the groups flattened (flattened-id
//             mode: with one replica the ids are partition ids), all of size
//             group_size = P; communication_id: i64 (XLA's clique key salt)
//
//   y_i[src] = x_i@src[me] for every buffer i and group rank src, where a rank
//   is a position in the caller's replica group (NCCL rank of XLA's clique).
//
// Prepare stage: validates the groups and requests the clique. Execute stage:
// gets the communicator and issues, for every non-empty buffer, one ncclSend
// and one ncclRecv per rank (the self block included: NCCL copies it inside
// the same fused kernel), all in ONE ncclGroupStart/ncclGroupEnd on XLA's
// stream. No allocation on the device, no synchronization, no host reads of
// device data: the execute stage is command-buffer compatible (NCCL supports
// stream capture).
#include "nccl_all_to_all.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "collectives_ext.h"
#include "nccl_loader.h"
#include "replica_groups.h"
#include "xla/ffi/api/collectives_api.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_checks.h"

namespace ffi = xla::ffi;

namespace moe_jax::cuda {
namespace {

constexpr std::string_view kName = "moe_jax_nccl_all_to_all";

//===----------------------------------------------------------------------===//
// Operands
//===----------------------------------------------------------------------===//

bool SameShape(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  if (a.element_type() != b.element_type()) return false;
  const auto da = a.dimensions();
  const auto db = b.dimensions();
  return da.size() == db.size() && std::equal(da.begin(), da.end(), db.begin());
}

// Validates operand/result i; on success sets the bytes of one rank's block.
ffi::Error CheckPair(size_t i, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                     int64_t group_size, size_t* block_bytes) {
  const auto dims = x.dimensions();
  if (!ByteSized(x.element_type()) || dims.size() < 1 ||
      dims[0] != group_size) {
    return Invalid(
        kName, "operand " + std::to_string(i) +
                   " must have shape [P, C, ...] with P = group_size = " +
                   std::to_string(group_size) +
                   " and a dtype of whole-byte elements, got " + Describe(x));
  }
  if (!SameShape(x, y)) {
    return Invalid(kName, "result " + std::to_string(i) +
                              " must have the dtype and shape of operand " +
                              std::to_string(i) + " (" + Describe(x) +
                              "), got " + Describe(y));
  }
  *block_bytes = x.size_bytes() / static_cast<size_t>(group_size);
  if (*block_bytes != 0 &&
      (x.untyped_data() == nullptr || y.untyped_data() == nullptr)) {
    return Invalid(kName, "operand/result " + std::to_string(i) +
                              " has a null data pointer");
  }
  return ffi::Error::Success();
}

//===----------------------------------------------------------------------===//
// NCCL
//===----------------------------------------------------------------------===//

ffi::Error NcclError(const NcclApi& nccl, const char* call, ncclResult_t r,
                     ncclComm_t comm) {
  return Internal(kName, NcclErrorMessage(nccl, call, r, comm));
}

//===----------------------------------------------------------------------===//
// Stages
//===----------------------------------------------------------------------===//

ffi::Error PrepareImpl(CollectivesContext collectives,
                       ffi::Span<const int64_t> replica_groups,
                       int64_t group_size, int64_t communication_id) {
  ffi::ErrorOr<const ReplicaGroups*> groups =
      ParseReplicaGroups(replica_groups, group_size, kName);
  if (!groups.has_value()) return groups.error();
  return collectives.RequestFlattened((*groups)->views, communication_id,
                                      kName);
}

ffi::Error ExecuteImpl(cudaStream_t stream, CollectivesContext collectives,
                       ffi::RemainingArgs args, ffi::RemainingRets rets,
                       ffi::Span<const int64_t> replica_groups,
                       int64_t group_size, int64_t communication_id) {
  ffi::ErrorOr<const ReplicaGroups*> groups =
      ParseReplicaGroups(replica_groups, group_size, kName);
  if (!groups.has_value()) return groups.error();

  const size_t n = args.size();
  if (n == 0 || rets.size() != n) {
    return Invalid(kName, "needs n >= 1 operands and as many results, got " +
                              std::to_string(n) + " operands and " +
                              std::to_string(rets.size()) + " results");
  }
  // Validate every pair before any NCCL call.
  size_t total_bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> x = args.get<ffi::AnyBuffer>(i);
    if (!x.has_value()) return x.error();
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> y = rets.get<ffi::AnyBuffer>(i);
    if (!y.has_value()) return y.error();
    size_t block = 0;
    if (ffi::Error err = CheckPair(i, *x, **y, group_size, &block);
        err.failure()) {
      return err;
    }
    total_bytes += block;
  }

  std::string load_error;
  const NcclApi* nccl = LoadNccl(&load_error);
  if (nccl == nullptr) return ffi::Error::Internal(load_error);

  ffi::ErrorOr<XLA_FFI_Communicator*> handle =
      collectives.GetFlattened((*groups)->views, communication_id, kName);
  if (!handle.has_value()) return handle.error();
  ncclComm_t comm = reinterpret_cast<ncclComm_t>(*handle);

  const int count = static_cast<int>(group_size);
  int rank = -1;
  if (std::string err = CommRank(*nccl, comm, group_size, &rank);
      !err.empty()) {
    return Internal(kName, err);
  }
  if (total_bytes == 0) return ffi::Error::Success();  // nothing to move

  if (ncclResult_t r = nccl->GroupStart(); r != ncclSuccess) {
    return NcclError(*nccl, "ncclGroupStart", r, comm);
  }
  // Rank p's block of buffer i: bytes [p * block, (p + 1) * block). Send my
  // block p to rank p, receive rank p's block `rank` into my block p.
  const char* failed = nullptr;
  ncclResult_t result = ncclSuccess;
  for (size_t i = 0; i < n && failed == nullptr; ++i) {
    ffi::AnyBuffer x = *args.get<ffi::AnyBuffer>(i);
    ffi::AnyBuffer y = **rets.get<ffi::AnyBuffer>(i);
    const size_t block = x.size_bytes() / static_cast<size_t>(group_size);
    if (block == 0) continue;  // C_i = 0 (or a zero trailing dimension)
    const char* send = static_cast<const char*>(x.untyped_data());
    char* recv = static_cast<char*>(y.untyped_data());
    for (int p = 0; p < count; ++p) {
      const size_t offset = static_cast<size_t>(p) * block;
      result = nccl->Send(send + offset, block, ncclUint8, p, comm, stream);
      if (result != ncclSuccess) {
        failed = "ncclSend";
        break;
      }
      result = nccl->Recv(recv + offset, block, ncclUint8, p, comm, stream);
      if (result != ncclSuccess) {
        failed = "ncclRecv";
        break;
      }
    }
  }
  // The group is always closed, also after a failed call inside it: an open
  // group would swallow XLA's next NCCL calls on this thread.
  const ncclResult_t end = SettleNccl(*nccl, comm, nccl->GroupEnd());
  if (failed != nullptr) return NcclError(*nccl, failed, result, comm);
  if (end != ncclSuccess) return NcclError(*nccl, "ncclGroupEnd", end, comm);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_jax::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeJaxNcclAllToAllPrepare, moe_jax::cuda::PrepareImpl,
    ffi::Ffi::BindPrepare()
        .Ctx<ffi::Extension<moe_jax::cuda::Collectives>>()
        .Attr<ffi::Span<const int64_t>>("replica_groups")
        .Attr<int64_t>("group_size")
        .Attr<int64_t>("communication_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeJaxNcclAllToAllExecute, moe_jax::cuda::ExecuteImpl,
    ffi::Ffi::BindExecute()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::Extension<moe_jax::cuda::Collectives>>()
        .RemainingArgs()   // x_0 .. x_{n-1}
        .RemainingRets()   // y_0 .. y_{n-1}
        .Attr<ffi::Span<const int64_t>>("replica_groups")
        .Attr<int64_t>("group_size")
        .Attr<int64_t>("communication_id"),
    {ffi::Traits::kCmdBufferCompatible});

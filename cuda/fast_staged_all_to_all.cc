// moe_jax_fast_staged_all_to_all on CUDA: a ragged all-to-all moved along
// the FAST schedule (xla_ffi/fast) with NCCL send/recv on XLA's own
// communicator (FFI collectives extension, as moe_jax_nccl_all_to_all).
//
//   operands  x: [R, ...] any whole-byte dtype, rows grouped by destination
//             traffic: s32[P, P], rows rank s sends to rank d (the same on
//             every rank; row sums <= R, column sums <= R_out)
//   results   out: [R_out, ...] x's dtype, rows grouped by source, zero past
//             the received total
//             workspace: [W, ...] x's dtype, relayed rows (scratch)
//   attrs     replica_groups: i64[G * P] (flattened ids), group_size = P,
//             communication_id: i64, num_servers, gpus_per_server (n * M = P)
//
// Prepare stage: validates the attributes and requests the clique. Execute
// stage (host work every call, hence NOT command-buffer compatible):
//   1. validates operands and results;
//   2. gets the communicator and this rank (its NCCL rank = position in the
//      replica group);
//   3. copies `traffic` to the host and synchronizes XLA's stream;
//   4. runs the C++ FAST scheduler and execution planner (the same plan on
//      every rank, checked as a whole so every rank takes the same
//      decision) and extracts this rank's program;
//   5. zeroes out[recv_total:] and issues every phase: local rows with
//      cudaMemcpyAsync, then all of the phase's ncclSend/ncclRecv in one
//      ncclGroupStart/ncclGroupEnd, on XLA's stream (xla_ffi/fast/issue.h,
//      the code the CPU simulation tests).
// Every CUDA and NCCL return code becomes an ffi::Error with its text.
#include "fast_staged_all_to_all.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "collectives_ext.h"
#include "nccl_loader.h"
#include "replica_groups.h"
#include "xla/ffi/api/collectives_api.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/fast/issue.h"
#include "xla_ffi/fast/plan.h"
#include "xla_ffi/ffi_checks.h"

namespace ffi = xla::ffi;

namespace moe_jax::cuda {
namespace {

constexpr std::string_view kName = "moe_jax_fast_staged_all_to_all";

//===----------------------------------------------------------------------===//
// Attributes
//===----------------------------------------------------------------------===//

// Checks the attributes; on success sets *groups to the parsed replica groups.
ffi::Error CheckAttrs(ffi::Span<const int64_t> replica_groups,
                      int64_t group_size, int64_t num_servers,
                      int64_t gpus_per_server, const ReplicaGroups** groups) {
  ffi::ErrorOr<const ReplicaGroups*> parsed =
      ParseReplicaGroups(replica_groups, group_size, kName);
  if (!parsed.has_value()) return parsed.error();
  if (num_servers < 1 || gpus_per_server < 1 ||
      num_servers * gpus_per_server != group_size) {
    return Invalid(kName,
                   "attributes `num_servers` x `gpus_per_server` must equal "
                   "group_size = " + std::to_string(group_size) + ", got " +
                       std::to_string(num_servers) + " x " +
                       std::to_string(gpus_per_server));
  }
  *groups = *parsed;
  return ffi::Error::Success();
}

//===----------------------------------------------------------------------===//
// Operands
//===----------------------------------------------------------------------===//

// Same dtype and trailing dimensions as x (the row shape).
bool SameRows(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  const auto dx = x.dimensions(), dy = y.dimensions();
  return x.element_type() == y.element_type() && dx.size() == dy.size() &&
         std::equal(dx.begin() + 1, dx.end(), dy.begin() + 1);
}

struct Sizes {
  int64_t rows_in = 0, rows_out = 0, ws_rows = 0;
  size_t row_bytes = 0;
};

ffi::Error CheckBuffers(const ffi::AnyBuffer& x, const ffi::AnyBuffer& traffic,
                        const ffi::AnyBuffer& out, const ffi::AnyBuffer& ws,
                        int64_t group_size, Sizes* s) {
  const auto dx = x.dimensions();
  if (!ByteSized(x.element_type()) || dx.size() < 1 || dx[0] < 1) {
    return Bad(kName, "x", "[R >= 1, ...] of a whole-byte dtype", x);
  }
  if (traffic.element_type() != ffi::DataType::S32 ||
      !HasDims(traffic, {group_size, group_size})) {
    return Bad(kName, "traffic", Shape("s32", {group_size, group_size}),
               traffic);
  }
  if (!SameRows(x, out) || out.dimensions()[0] < 1) {
    return BadResult(kName, "out", "[R_out >= 1, ...] with x's dtype and row "
                     "shape (x is " + Describe(x) + ")", out);
  }
  if (!SameRows(x, ws)) {
    return BadResult(kName, "workspace", "[W, ...] with x's dtype and row "
                     "shape (x is " + Describe(x) + ")", ws);
  }
  s->rows_in = dx[0];
  s->rows_out = out.dimensions()[0];
  s->ws_rows = ws.dimensions()[0];
  s->row_bytes = x.size_bytes() / static_cast<size_t>(s->rows_in);
  if (s->row_bytes > 0 && (x.untyped_data() == nullptr ||
                           out.untyped_data() == nullptr ||
                           traffic.untyped_data() == nullptr ||
                           (s->ws_rows > 0 && ws.untyped_data() == nullptr))) {
    return Invalid(kName, "an operand or result has a null data pointer");
  }
  return ffi::Error::Success();
}

//===----------------------------------------------------------------------===//
// Transport: NCCL and CUDA on XLA's stream (issue.h's interface)
//===----------------------------------------------------------------------===//

std::string CudaText(const char* call, cudaError_t err) {
  return Prefixed(kName, std::string(call) + " failed: " + CudaErrorText(err));
}

std::string NcclText(const NcclApi& nccl, const char* call, ncclResult_t r,
                     ncclComm_t comm) {
  return Prefixed(kName, NcclErrorMessage(nccl, call, r, comm));
}

class NcclTransport {
 public:
  NcclTransport(const NcclApi& nccl, ncclComm_t comm, cudaStream_t stream,
                const void* x, void* out, void* ws, size_t row_bytes)
      : nccl_(nccl), comm_(comm), stream_(stream),
        x_(static_cast<const char*>(x)), out_(static_cast<char*>(out)),
        ws_(static_cast<char*>(ws)), row_bytes_(row_bytes) {}

  std::string Zero(int64_t row, int64_t rows) {
    const cudaError_t err =
        cudaMemsetAsync(out_ + Bytes(row), 0, Bytes(rows), stream_);
    return err == cudaSuccess ? std::string() : CudaText("cudaMemsetAsync", err);
  }

  std::string Copy(const fast::RankOp& op) {
    const cudaError_t err = cudaMemcpyAsync(
        Dst(op), Src(op), Bytes(op.rows), cudaMemcpyDeviceToDevice, stream_);
    return err == cudaSuccess ? std::string() : CudaText("cudaMemcpyAsync", err);
  }

  std::string GroupStart() {
    const ncclResult_t r = nccl_.GroupStart();
    return r == ncclSuccess ? std::string()
                            : NcclText(nccl_, "ncclGroupStart", r, comm_);
  }

  std::string Send(const fast::RankOp& op) {
    const ncclResult_t r = nccl_.Send(Src(op), Bytes(op.rows), ncclUint8,
                                      op.peer, comm_, stream_);
    return r == ncclSuccess ? std::string() : NcclText(nccl_, "ncclSend", r, comm_);
  }

  std::string Recv(const fast::RankOp& op) {
    const ncclResult_t r = nccl_.Recv(Dst(op), Bytes(op.rows), ncclUint8,
                                      op.peer, comm_, stream_);
    return r == ncclSuccess ? std::string() : NcclText(nccl_, "ncclRecv", r, comm_);
  }

  std::string GroupEnd() {
    const ncclResult_t r = SettleNccl(nccl_, comm_, nccl_.GroupEnd());
    return r == ncclSuccess ? std::string()
                            : NcclText(nccl_, "ncclGroupEnd", r, comm_);
  }

 private:
  size_t Bytes(int64_t rows) const {
    return static_cast<size_t>(rows) * row_bytes_;
  }
  const char* Src(const fast::RankOp& op) const {
    return (op.src_buf == fast::kBufWs ? ws_ : x_) + Bytes(op.src_row);
  }
  char* Dst(const fast::RankOp& op) const {
    return (op.dst_buf == fast::kBufWs ? ws_ : out_) + Bytes(op.dst_row);
  }

  const NcclApi& nccl_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  const char* x_;
  char* out_;
  char* ws_;
  size_t row_bytes_;
};

// Per-thread state reused between calls (XLA runs each device's program on
// its own thread): the planner's buffers, the host copy of the traffic and
// this rank's program.
struct ThreadState {
  fast::StagedPlanner planner;
  std::vector<int32_t> traffic;
  fast::RankProgram program;
};

ThreadState& State() {
  static thread_local ThreadState state;
  return state;
}

//===----------------------------------------------------------------------===//
// Stages
//===----------------------------------------------------------------------===//

ffi::Error PrepareImpl(CollectivesContext collectives,
                       ffi::Span<const int64_t> replica_groups,
                       int64_t group_size, int64_t communication_id,
                       int64_t num_servers, int64_t gpus_per_server) {
  const ReplicaGroups* groups = nullptr;
  if (ffi::Error err = CheckAttrs(replica_groups, group_size, num_servers,
                                  gpus_per_server, &groups);
      err.failure()) {
    return err;
  }
  return collectives.RequestFlattened(groups->views, communication_id, kName);
}

ffi::Error ExecuteImpl(cudaStream_t stream, CollectivesContext collectives,
                       ffi::AnyBuffer x, ffi::AnyBuffer traffic,
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> ws,
                       ffi::Span<const int64_t> replica_groups,
                       int64_t group_size, int64_t communication_id,
                       int64_t num_servers, int64_t gpus_per_server) {
  const ReplicaGroups* groups = nullptr;
  if (ffi::Error err = CheckAttrs(replica_groups, group_size, num_servers,
                                  gpus_per_server, &groups);
      err.failure()) {
    return err;
  }
  Sizes sizes;
  if (ffi::Error err = CheckBuffers(x, traffic, *out, *ws, group_size, &sizes);
      err.failure()) {
    return err;
  }

  std::string load_error;
  const NcclApi* nccl = LoadNccl(&load_error);
  if (nccl == nullptr) return Internal(kName, load_error);
  ffi::ErrorOr<XLA_FFI_Communicator*> handle =
      collectives.GetFlattened(groups->views, communication_id, kName);
  if (!handle.has_value()) return handle.error();
  ncclComm_t comm = reinterpret_cast<ncclComm_t>(*handle);
  int rank = -1;
  if (std::string err = CommRank(*nccl, comm, group_size, &rank);
      !err.empty()) {
    return Internal(kName, err);
  }

  // The traffic matrix, on the host (waits for everything before it on
  // XLA's stream, the all-gather of the counts included).
  ThreadState& st = State();
  st.traffic.resize(static_cast<size_t>(group_size) * group_size);
  if (cudaError_t err = cudaMemcpyAsync(
          st.traffic.data(), traffic.untyped_data(),
          st.traffic.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
      err != cudaSuccess) {
    return ffi::Error::Internal(CudaText("cudaMemcpyAsync (traffic to host)", err));
  }
  if (cudaError_t err = cudaStreamSynchronize(stream); err != cudaSuccess) {
    return ffi::Error::Internal(CudaText("cudaStreamSynchronize", err));
  }

  // This rank's program: from its per-GPU schedule with a workspace of the
  // proven bound, else from the whole plan, so that a workspace too small
  // for any rank fails on every rank alike (no rank waits in NCCL for one
  // that stopped).
  const fast::PlanStatus planned = st.planner.BuildRank(
      st.traffic.data(), static_cast<int>(num_servers),
      static_cast<int>(gpus_per_server), sizes.rows_in, sizes.rows_out,
      sizes.ws_rows, rank, &st.program);
  switch (planned.failure) {
    case fast::PlanFailure::kNone:
      break;
    case fast::PlanFailure::kTraffic:
      return Invalid(kName, "operand `traffic`: " + planned.message);
    case fast::PlanFailure::kWorkspace:
      return Invalid(kName, planned.message);
    case fast::PlanFailure::kInternal:
      return Internal(kName, planned.message);
  }
  if (sizes.row_bytes == 0) return ffi::Error::Success();  // nothing to move

  NcclTransport transport(*nccl, comm, stream, x.untyped_data(),
                          out->untyped_data(), ws->untyped_data(),
                          sizes.row_bytes);
  if (std::string err = fast::IssueAll(st.program, sizes.rows_out, transport);
      !err.empty()) {
    return ffi::Error::Internal(err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_jax::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeJaxFastStagedAllToAllPrepare, moe_jax::cuda::PrepareImpl,
    ffi::Ffi::BindPrepare()
        .Ctx<ffi::Extension<moe_jax::cuda::Collectives>>()
        .Attr<ffi::Span<const int64_t>>("replica_groups")
        .Attr<int64_t>("group_size")
        .Attr<int64_t>("communication_id")
        .Attr<int64_t>("num_servers")
        .Attr<int64_t>("gpus_per_server"));

// No ffi::Traits::kCmdBufferCompatible: the execute stage reads device data
// on the host and synchronizes the stream, so it must not be captured into
// a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeJaxFastStagedAllToAllExecute, moe_jax::cuda::ExecuteImpl,
    ffi::Ffi::BindExecute()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::Extension<moe_jax::cuda::Collectives>>()
        .Arg<ffi::AnyBuffer>()          // x
        .Arg<ffi::AnyBuffer>()          // traffic
        .Ret<ffi::AnyBuffer>()          // out
        .Ret<ffi::AnyBuffer>()          // workspace
        .Attr<ffi::Span<const int64_t>>("replica_groups")
        .Attr<int64_t>("group_size")
        .Attr<int64_t>("communication_id")
        .Attr<int64_t>("num_servers")
        .Attr<int64_t>("gpus_per_server"));

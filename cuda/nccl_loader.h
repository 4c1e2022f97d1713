// The few NCCL entry points moe_jax_nccl_all_to_all (and the NVLink
// transport's one-time handle exchange) need, resolved at first
// use from the libnccl.so.2 that the JAX CUDA plugin already loaded into the
// process: dlopen("libnccl.so.2", RTLD_NOLOAD) (matches the loaded object's
// soname), else any loaded object named libnccl.so* (dl_iterate_phdr), and
// only then a plain dlopen. The extension never links libnccl, so it talks to
// XLA's own NCCL: the communicators XLA hands out through the collectives
// extension belong to it (a second NCCL copy must never see them).
#ifndef MOE_JAX_CUDA_NCCL_LOADER_H_
#define MOE_JAX_CUDA_NCCL_LOADER_H_

#include <cstdint>
#include <string>

#include <nccl.h>

namespace moe_jax::cuda {

struct NcclApi {
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t,
                       cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t,
                       cudaStream_t) = nullptr;
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                            cudaStream_t) = nullptr;
  ncclResult_t (*CommCount)(const ncclComm_t, int*) = nullptr;
  ncclResult_t (*CommUserRank)(const ncclComm_t, int*) = nullptr;
  // Needed only for non-blocking communicators (ncclInProgress).
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  // Optional (NCCL >= 2.13): the last error's detail text; may stay null.
  const char* (*GetLastError)(ncclComm_t) = nullptr;

  int version = 0;          // ncclGetVersion, e.g. 22807
  std::string library;      // path of the loaded library (dladdr)
  bool already_loaded = false;  // found with RTLD_NOLOAD
};

// Returns the process-wide table, loading it on the first successful call
// (thread-safe; the table lives in a function-local static and is never
// freed). On failure returns nullptr and stores in `*error` what was missing;
// failures are not cached, so a later call (after XLA has loaded NCCL) can
// still succeed. Call it from the execute stage only: by then XLA has created
// its communicators, so its NCCL is in the process.
const NcclApi* LoadNccl(std::string* error);

// The table if LoadNccl already succeeded, else nullptr; loads nothing.
const NcclApi* LoadedNccl();

// "<call> failed: <ncclGetErrorString> (<code>)[: <ncclGetLastError>]".
std::string NcclErrorMessage(const NcclApi& nccl, const char* call,
                             ncclResult_t result, ncclComm_t comm);

// Non-blocking communicators may answer ncclInProgress: waits until the
// operation is enqueued (what a blocking communicator's call returns after)
// and returns its final result. Blocking communicators return `result` as is.
ncclResult_t SettleNccl(const NcclApi& nccl, ncclComm_t comm, ncclResult_t result);

// Sets *rank to this process's rank in `comm` (XLA's communicator of a
// replica group) after checking that `comm` has group_size ranks. Returns ""
// on success, else the error text (an NcclErrorMessage or the mismatch).
std::string CommRank(const NcclApi& nccl, ncclComm_t comm, int64_t group_size, int* rank);

}  // namespace moe_jax::cuda

#endif  // MOE_JAX_CUDA_NCCL_LOADER_H_

// The NVLink transport's one-time exchange over XLA's NCCL communicator
// (multi-process meshes): this rank's place in the communicator, and an
// all-gather of a few host bytes from every rank. Host code; NCCL is the
// copy XLA loaded (nccl_loader.h). Neither call is graph-capturable: the
// all-gather synchronizes with the host, so it runs once per channel,
// outside any capture.
#ifndef MOE_JAX_CUDA_NVLINK_EXCHANGE_H_
#define MOE_JAX_CUDA_NVLINK_EXCHANGE_H_

#include <cstddef>
#include <string>

namespace moe_jax::cuda::nvlink {

// Rank of this device in `comm` (an ncclComm_t handed out by XLA) and the
// number of ranks. On failure returns false and sets *error (NCCL's text).
bool CommRankAndCount(void* comm, int* rank, int* count, std::string* error);

// all[r * bytes, (r + 1) * bytes) = `mine` of rank r, for every rank of
// `comm`: ncclAllGather through small device buffers on a private stream of
// the current device, then a synchronization. Every rank must call it.
// `all` holds count * bytes. On failure returns false and sets *error.
bool AllGatherHostBytes(void* comm, const void* mine, void* all, size_t bytes, int count,
                        std::string* error);

}  // namespace moe_jax::cuda::nvlink

#endif  // MOE_JAX_CUDA_NVLINK_EXCHANGE_H_

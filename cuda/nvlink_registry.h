// Channels of the NVLink transport, never freed.
//
// One process (GetChannel): created once per (group of devices, shape) for
// the whole group, one block on every member device, peer access between
// every pair.
//
// Several processes (OpenSharedChannel): each process allocates the blocks
// of its own devices; the members of a group exchange their blocks' CUDA IPC
// handles once (all-gather over XLA's communicator) and map each other's
// blocks: cudaIpcOpenMemHandle for members of other processes, the plain
// pointer (with peer access) for members of the same process.
#ifndef MOE_JAX_CUDA_NVLINK_REGISTRY_H_
#define MOE_JAX_CUDA_NVLINK_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "nvlink_channel.h"

namespace moe_jax::cuda::nvlink {

struct Channel {
  ChannelShape shape;
  std::vector<int> ordinals;      // CUDA device of each rank
  std::vector<uint8_t*> blocks;   // each rank's allocation, on its device

  // The kernels' view from `rank`.
  ChannelView ViewFrom(int rank) const;
};

// The channel of these devices (rank order) and shape, created on first use:
// one zeroed allocation per device, peer access enabled between every pair.
// Thread-safe. On failure returns nullptr and sets *error.
const Channel* GetChannel(const std::vector<int>& ordinals, const ChannelShape& shape,
                          std::string* error);

// Existing channel only (nullptr if GetChannel was never called for it).
const Channel* FindChannel(const std::vector<int>& ordinals, const ChannelShape& shape);

// Multi-process: what one rank publishes to its group (plain bytes, the same
// layout in every process of one build).
struct PeerRecord {
  cudaIpcMemHandle_t handle;  // its channel block
  char host[64];              // gethostname, NUL-terminated
  int64_t pid;
  int32_t device;             // CUDA ordinal in its process
  int32_t failed;             // 1: it could not allocate its block (no handle)
};

// Gathers every rank's record (rank order) into *all; false + *error on failure.
using GatherRecords = std::function<bool(const PeerRecord& mine, std::vector<PeerRecord>* all,
                                         std::string* error)>;

// The kernels' view of `device`'s channel in the group behind `group_key`
// (XLA's communicator of the group: one per device and group), or nullptr if
// OpenSharedChannel has not opened it yet. Host only, no CUDA call:
// graph-capturable.
const ChannelView* FindSharedChannel(const void* group_key, int device, const ChannelShape& shape);

// Opens that channel once: allocates and zeroes this device's block, takes
// its IPC handle, gathers the records of all `shape.num_ranks` ranks (every
// rank must call this once), maps the peers' blocks and configures the
// kernels. `rank` is this device's rank in the group. Synchronizes with the
// host: call it outside graph capture. Thread-safe (the gather runs without
// holding the registry lock). On failure returns nullptr and sets *error.
const ChannelView* OpenSharedChannel(const void* group_key, int device, int rank,
                                     const ChannelShape& shape, const GatherRecords& gather,
                                     std::string* error);

}  // namespace moe_jax::cuda::nvlink

#endif  // MOE_JAX_CUDA_NVLINK_REGISTRY_H_

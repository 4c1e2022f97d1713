// Channels of the NVLink transport: created once per (group of devices,
// shape) for the whole group, on every member device, and never freed.
#ifndef MOE_JAX_CUDA_NVLINK_REGISTRY_H_
#define MOE_JAX_CUDA_NVLINK_REGISTRY_H_

#include <cstdint>
#include <string>
#include <vector>

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

}  // namespace moe_jax::cuda::nvlink

#endif  // MOE_JAX_CUDA_NVLINK_REGISTRY_H_

#include "nvlink_registry.h"

#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include <cuda_runtime_api.h>

namespace moe_jax::cuda::nvlink {
namespace {

using Key = std::tuple<std::vector<int>, int32_t, int32_t, int64_t, int32_t, int64_t, int32_t>;

Key KeyOf(const std::vector<int>& ordinals, const ChannelShape& s) {
  return {ordinals, s.num_ranks, s.experts_per_rank, s.tokens, s.top_k, s.row_bytes,
          s.dispatch_fp8};
}

std::mutex& Mutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}

std::map<Key, std::unique_ptr<Channel>>& Channels() {
  static auto* channels = new std::map<Key, std::unique_ptr<Channel>>;
  return *channels;
}

std::string CudaText(const char* what, int device, cudaError_t err) {
  return std::string(what) + " on GPU " + std::to_string(device) + " failed: " +
         cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
}

// Restores the calling thread's current device on scope exit.
class DeviceGuard {
 public:
  DeviceGuard() { cudaGetDevice(&saved_); }
  ~DeviceGuard() { cudaSetDevice(saved_); }

 private:
  int saved_ = 0;
};

// One zeroed block of `bytes` on the current device `dev`, kernels
// configured for `shape`. On failure returns nullptr and sets *error.
uint8_t* AllocateZeroedBlock(int dev, const ChannelShape& shape, std::string* error) {
  const size_t bytes = static_cast<size_t>(shape.TotalBytes());
  uint8_t* block = nullptr;
  cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&block), bytes);
  if (err != cudaSuccess) {
    *error = CudaText(("cudaMalloc of " + std::to_string(bytes) + " channel bytes").c_str(),
                      dev, err);
    return nullptr;
  }
  // A private stream: the memset must not join (or break) a capture that
  // another thread runs on the legacy default stream.
  cudaStream_t stream = nullptr;
  err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaMemsetAsync(block, 0, bytes, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (stream != nullptr) cudaStreamDestroy(stream);
  if (err == cudaSuccess) err = ConfigureKernels(shape);
  if (err != cudaSuccess) {
    cudaFree(block);
    *error = CudaText("initializing the channel buffers", dev, err);
    return nullptr;
  }
  return block;
}

// Peer access from the current device `dev` to `peer` (idempotent).
bool EnablePeerAccess(int dev, int peer, std::string* error) {
  int can = 0;
  cudaError_t err = cudaDeviceCanAccessPeer(&can, dev, peer);
  if (err != cudaSuccess || !can) {
    *error = "GPU " + std::to_string(dev) + " cannot access GPU " + std::to_string(peer) +
             " directly (no NVLink/PCIe peer access); use another transport";
    return false;
  }
  err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // clears this (non-sticky) error
  } else if (err != cudaSuccess) {
    *error = CudaText(("enabling peer access to GPU " + std::to_string(peer)).c_str(), dev, err);
    return false;
  }
  return true;
}

std::unique_ptr<Channel> Create(const std::vector<int>& ordinals, const ChannelShape& shape,
                                std::string* error) {
  auto ch = std::make_unique<Channel>();
  ch->shape = shape;
  ch->ordinals = ordinals;
  DeviceGuard guard;
  for (int dev : ordinals) {
    cudaError_t err = cudaSetDevice(dev);
    if (err != cudaSuccess) {
      *error = CudaText("cudaSetDevice", dev, err);
      return nullptr;
    }
    uint8_t* block = AllocateZeroedBlock(dev, shape, error);
    if (block == nullptr) return nullptr;
    ch->blocks.push_back(block);
    for (int peer : ordinals) {
      if (peer != dev && !EnablePeerAccess(dev, peer, error)) return nullptr;
    }
  }
  return ch;
}

//===----------------------------------------------------------------------===//
// Multi-process channels
//===----------------------------------------------------------------------===//

using SharedKey = std::tuple<const void*, int, Key>;

std::map<SharedKey, std::unique_ptr<ChannelView>>& SharedChannels() {
  static auto* channels = new std::map<SharedKey, std::unique_ptr<ChannelView>>;
  return *channels;
}

std::string HandleBytes(const cudaIpcMemHandle_t& h) {
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

// This process's shared blocks by IPC handle: a member of the same process
// maps another's block by its plain pointer (a process cannot open its own
// IPC handles).
struct LocalBlock {
  uint8_t* block;
  int device;
};

std::map<std::string, LocalBlock>& LocalBlocks() {
  static auto* blocks = new std::map<std::string, LocalBlock>;
  return *blocks;
}

// This rank's record: its block's handle, or failed = 1 (and *error set)
// when it has none. Registers the block in LocalBlocks().
PeerRecord PublishBlock(int dev, const ChannelShape& shape, uint8_t** block,
                        std::string* error) {
  PeerRecord mine{};
  mine.pid = static_cast<int64_t>(getpid());
  mine.device = dev;
  gethostname(mine.host, sizeof(mine.host) - 1);
  *block = AllocateZeroedBlock(dev, shape, error);
  if (*block != nullptr) {
    cudaError_t err = cudaIpcGetMemHandle(&mine.handle, *block);
    if (err != cudaSuccess) {
      *error = CudaText("cudaIpcGetMemHandle of the channel block", dev, err);
      cudaFree(*block);
      *block = nullptr;
    }
  }
  mine.failed = *block == nullptr ? 1 : 0;
  if (*block != nullptr) {
    std::lock_guard<std::mutex> lock(Mutex());
    LocalBlocks()[HandleBytes(mine.handle)] = LocalBlock{*block, dev};
  }
  return mine;
}

// Rank `r`'s block as seen from the current device `dev`.
uint8_t* MapPeerBlock(int dev, int r, const PeerRecord& mine, const PeerRecord& peer,
                      std::string* error) {
  const std::string where = "rank " + std::to_string(r) + " (GPU " + std::to_string(peer.device) +
                            " of process " + std::to_string(peer.pid) + " on " + peer.host + ")";
  if (std::strncmp(mine.host, peer.host, sizeof(mine.host)) != 0) {
    *error = where + " is on another host than this rank (" + mine.host +
             "): the NVLink transport needs every expert group inside one node (one NVLink "
             "domain); use transport 'custom_call' across nodes";
    return nullptr;
  }
  if (peer.pid == mine.pid) {
    LocalBlock local{};
    {
      std::lock_guard<std::mutex> lock(Mutex());
      auto it = LocalBlocks().find(HandleBytes(peer.handle));
      if (it == LocalBlocks().end()) {
        *error = where + " is in this process but its channel block is unknown here";
        return nullptr;
      }
      local = it->second;
    }
    if (local.device != dev && !EnablePeerAccess(dev, local.device, error)) return nullptr;
    return local.block;
  }
  void* mapped = nullptr;
  cudaError_t err = cudaIpcOpenMemHandle(&mapped, peer.handle, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    *error = CudaText(("cudaIpcOpenMemHandle of the channel block of " + where +
                       " (the GPUs of an expert group must share one node and have peer "
                       "access)").c_str(),
                      dev, err);
    return nullptr;
  }
  return static_cast<uint8_t*>(mapped);
}

// Every rank's block mapped on `dev`, or an error naming the first failure.
bool MapGroup(int dev, int rank, uint8_t* own, const std::vector<PeerRecord>& all,
              ChannelView* view, std::string* error) {
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].failed) {
      *error = "rank " + std::to_string(r) + " (GPU " + std::to_string(all[r].device) + " on " +
               all[r].host + ") could not allocate its channel block; see its error";
      return false;
    }
  }
  for (size_t r = 0; r < all.size(); ++r) {
    view->base[r] = static_cast<int>(r) == rank
                        ? own
                        : MapPeerBlock(dev, static_cast<int>(r), all[rank], all[r], error);
    if (view->base[r] == nullptr) return false;
  }
  return true;
}

}  // namespace

ChannelView Channel::ViewFrom(int rank) const {
  ChannelView v;
  v.shape = shape;
  v.rank = rank;
  for (size_t r = 0; r < blocks.size(); ++r) v.base[r] = blocks[r];
  return v;
}

const Channel* GetChannel(const std::vector<int>& ordinals, const ChannelShape& shape,
                          std::string* error) {
  std::lock_guard<std::mutex> lock(Mutex());
  auto& channels = Channels();
  const Key key = KeyOf(ordinals, shape);
  auto it = channels.find(key);
  if (it != channels.end()) return it->second.get();
  std::unique_ptr<Channel> ch = Create(ordinals, shape, error);
  if (ch == nullptr) return nullptr;
  return channels.emplace(key, std::move(ch)).first->second.get();
}

const Channel* FindChannel(const std::vector<int>& ordinals, const ChannelShape& shape) {
  std::lock_guard<std::mutex> lock(Mutex());
  auto& channels = Channels();
  auto it = channels.find(KeyOf(ordinals, shape));
  return it == channels.end() ? nullptr : it->second.get();
}

const ChannelView* FindSharedChannel(const void* group_key, int device,
                                     const ChannelShape& shape) {
  std::lock_guard<std::mutex> lock(Mutex());
  auto& channels = SharedChannels();
  auto it = channels.find(SharedKey{group_key, device, KeyOf({}, shape)});
  return it == channels.end() ? nullptr : it->second.get();
}

const ChannelView* OpenSharedChannel(const void* group_key, int device, int rank,
                                     const ChannelShape& shape, const GatherRecords& gather,
                                     std::string* error) {
  if (const ChannelView* found = FindSharedChannel(group_key, device, shape)) return found;
  DeviceGuard guard;
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    *error = CudaText("cudaSetDevice", device, err);
    return nullptr;
  }
  // A rank that fails here still joins the gather (failed = 1), so that
  // every rank of the group returns an error instead of waiting forever.
  std::string own_error;
  uint8_t* own = nullptr;
  const PeerRecord mine = PublishBlock(device, shape, &own, &own_error);
  std::vector<PeerRecord> all;
  if (!gather(mine, &all, error)) return nullptr;
  if (mine.failed) {
    *error = own_error;
    return nullptr;
  }
  if (all.size() != static_cast<size_t>(shape.num_ranks)) {
    *error = "the handle exchange returned " + std::to_string(all.size()) + " records for " +
             std::to_string(shape.num_ranks) + " ranks";
    return nullptr;
  }
  auto view = std::make_unique<ChannelView>();
  view->shape = shape;
  view->rank = rank;
  if (!MapGroup(device, rank, own, all, view.get(), error)) return nullptr;
  std::lock_guard<std::mutex> lock(Mutex());
  auto& channels = SharedChannels();
  return channels.emplace(SharedKey{group_key, device, KeyOf({}, shape)}, std::move(view))
      .first->second.get();
}

}  // namespace moe_jax::cuda::nvlink

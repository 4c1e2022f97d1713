#include "nvlink_registry.h"

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

std::unique_ptr<Channel> Create(const std::vector<int>& ordinals, const ChannelShape& shape,
                                std::string* error) {
  auto ch = std::make_unique<Channel>();
  ch->shape = shape;
  ch->ordinals = ordinals;
  DeviceGuard guard;
  const size_t bytes = static_cast<size_t>(shape.TotalBytes());
  for (int dev : ordinals) {
    cudaError_t err = cudaSetDevice(dev);
    uint8_t* block = nullptr;
    if (err == cudaSuccess) err = cudaMalloc(reinterpret_cast<void**>(&block), bytes);
    if (err != cudaSuccess) {
      *error = CudaText(("cudaMalloc of " + std::to_string(bytes) + " channel bytes").c_str(),
                        dev, err);
      return nullptr;
    }
    ch->blocks.push_back(block);
    // A private stream: the memset must not join (or break) a capture that
    // another thread runs on the legacy default stream.
    cudaStream_t stream = nullptr;
    err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaMemsetAsync(block, 0, bytes, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (err == cudaSuccess) err = ConfigureKernels(shape);
    if (err != cudaSuccess) {
      *error = CudaText("initializing the channel buffers", dev, err);
      return nullptr;
    }
    for (int peer : ordinals) {
      if (peer == dev) continue;
      int can = 0;
      err = cudaDeviceCanAccessPeer(&can, dev, peer);
      if (err != cudaSuccess || !can) {
        *error = "GPU " + std::to_string(dev) + " cannot access GPU " + std::to_string(peer) +
                 " directly (no NVLink/PCIe peer access); use another transport";
        return nullptr;
      }
      err = cudaDeviceEnablePeerAccess(peer, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clears this (non-sticky) error
      } else if (err != cudaSuccess) {
        *error = CudaText(("enabling peer access to GPU " + std::to_string(peer)).c_str(),
                          dev, err);
        return nullptr;
      }
    }
  }
  return ch;
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

}  // namespace moe_jax::cuda::nvlink

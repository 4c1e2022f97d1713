// ncclAllGather of host bytes over XLA's communicator (see nvlink_exchange.h).
#include "nvlink_exchange.h"

#include <string>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "nccl_loader.h"

namespace moe_jax::cuda::nvlink {
namespace {

std::string CudaText(const char* what, cudaError_t err) {
  return std::string(what) + " failed: " + cudaGetErrorName(err) + ": " +
         cudaGetErrorString(err);
}

// Device scratch and a private stream, released on scope exit.
class Scratch {
 public:
  ~Scratch() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (send_ != nullptr) cudaFree(send_);
    if (recv_ != nullptr) cudaFree(recv_);
  }

  cudaError_t Allocate(size_t bytes, int count) {
    cudaError_t err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaMalloc(&send_, bytes);
    if (err == cudaSuccess) err = cudaMalloc(&recv_, bytes * count);
    return err;
  }

  void* send() const { return send_; }
  void* recv() const { return recv_; }
  cudaStream_t stream() const { return stream_; }

 private:
  void* send_ = nullptr;
  void* recv_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

bool CommRankAndCount(void* comm, int* rank, int* count, std::string* error) {
  const NcclApi* nccl = LoadNccl(error);
  if (nccl == nullptr) return false;
  ncclComm_t c = static_cast<ncclComm_t>(comm);
  if (ncclResult_t r = nccl->CommCount(c, count); r != ncclSuccess) {
    *error = NcclErrorMessage(*nccl, "ncclCommCount", r, c);
    return false;
  }
  if (ncclResult_t r = nccl->CommUserRank(c, rank); r != ncclSuccess) {
    *error = NcclErrorMessage(*nccl, "ncclCommUserRank", r, c);
    return false;
  }
  return true;
}

bool AllGatherHostBytes(void* comm, const void* mine, void* all, size_t bytes, int count,
                        std::string* error) {
  const NcclApi* nccl = LoadNccl(error);
  if (nccl == nullptr) return false;
  ncclComm_t c = static_cast<ncclComm_t>(comm);
  Scratch scratch;
  cudaError_t err = scratch.Allocate(bytes, count);
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(scratch.send(), mine, bytes, cudaMemcpyHostToDevice, scratch.stream());
  }
  if (err != cudaSuccess) {
    *error = CudaText("staging the handle exchange", err);
    return false;
  }
  ncclResult_t r = nccl->AllGather(scratch.send(), scratch.recv(), bytes, ncclUint8, c,
                                   scratch.stream());
  r = SettleNccl(*nccl, c, r);
  if (r != ncclSuccess) {
    *error = NcclErrorMessage(*nccl, "ncclAllGather", r, c);
    return false;
  }
  err = cudaMemcpyAsync(all, scratch.recv(), bytes * count, cudaMemcpyDeviceToHost,
                        scratch.stream());
  if (err == cudaSuccess) err = cudaStreamSynchronize(scratch.stream());
  if (err != cudaSuccess) {
    *error = CudaText("the handle exchange (ncclAllGather on a private stream)", err);
    return false;
  }
  return true;
}

}  // namespace moe_jax::cuda::nvlink

// dlopen/dlsym of XLA's libnccl.so.2 (see nccl_loader.h).
#include "nccl_loader.h"

#include <dlfcn.h>
#include <link.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

namespace moe_jax::cuda {
namespace {

constexpr const char* kLibrary = "libnccl.so.2";

std::atomic<const NcclApi*> g_loaded{nullptr};

std::string DlError() {
  const char* e = dlerror();
  return e ? e : "unknown dlerror";
}

// Path of an already loaded object whose file name starts with "libnccl.so"
// (XLA's NCCL, however it was opened), or "" if none is loaded.
std::string LoadedNcclPath() {
  std::string found;
  dl_iterate_phdr(
      [](struct dl_phdr_info* info, size_t, void* data) -> int {
        const char* path = info->dlpi_name;
        if (path == nullptr || path[0] == '\0') return 0;
        const char* base = std::strrchr(path, '/');
        base = base ? base + 1 : path;
        if (std::strncmp(base, "libnccl.so", 10) != 0) return 0;
        *static_cast<std::string*>(data) = path;
        return 1;  // stop at the first
      },
      &found);
  return found;
}

template <typename Fn>
bool Resolve(void* handle, const char* name, Fn& fn, std::string* missing) {
  dlerror();  // clear
  fn = reinterpret_cast<Fn>(dlsym(handle, name));
  if (fn == nullptr) {
    if (!missing->empty()) *missing += ", ";
    *missing += name;
    return false;
  }
  return true;
}

std::unique_ptr<NcclApi> Load(std::string* error) {
  auto api = std::make_unique<NcclApi>();
  // The CUDA plugin's copy, matched by soname; no second NCCL is loaded.
  void* handle = dlopen(kLibrary, RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) {
    // Loaded under another name: find it among the loaded objects.
    const std::string path = LoadedNcclPath();
    if (!path.empty()) handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  }
  api->already_loaded = handle != nullptr;
  if (handle == nullptr) {
    // Last resort: nothing named libnccl is loaded yet.
    handle = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      *error = std::string("moe_jax_nccl_all_to_all: cannot load ") + kLibrary +
               " (it is not loaded in this process, and dlopen failed: " +
               DlError() +
               "); the JAX CUDA plugin's NCCL (the nvidia-nccl-cu13 wheel) "
               "should be loaded by the time a collective runs";
      return nullptr;
    }
  }
  // The handle is never closed: the table is used for the process lifetime.
  std::string missing;
  bool ok = true;
  ok &= Resolve(handle, "ncclGetErrorString", api->GetErrorString, &missing);
  ok &= Resolve(handle, "ncclGetVersion", api->GetVersion, &missing);
  ok &= Resolve(handle, "ncclGroupStart", api->GroupStart, &missing);
  ok &= Resolve(handle, "ncclGroupEnd", api->GroupEnd, &missing);
  ok &= Resolve(handle, "ncclSend", api->Send, &missing);
  ok &= Resolve(handle, "ncclRecv", api->Recv, &missing);
  ok &= Resolve(handle, "ncclAllGather", api->AllGather, &missing);
  ok &= Resolve(handle, "ncclCommCount", api->CommCount, &missing);
  ok &= Resolve(handle, "ncclCommUserRank", api->CommUserRank, &missing);
  ok &= Resolve(handle, "ncclCommGetAsyncError", api->CommGetAsyncError,
                &missing);
  Dl_info info{};
  if (api->GetVersion && dladdr(reinterpret_cast<void*>(api->GetVersion), &info) &&
      info.dli_fname) {
    api->library = info.dli_fname;
  } else {
    api->library = kLibrary;
  }
  if (!ok) {
    *error = "moe_jax_nccl_all_to_all: " + api->library +
             " lacks the symbol(s) " + missing + " (NCCL >= 2.7 is required)";
    return nullptr;
  }
  std::string unused;
  Resolve(handle, "ncclGetLastError", api->GetLastError, &unused);  // optional
  if (api->GetVersion(&api->version) != ncclSuccess) api->version = 0;
  return api;
}

}  // namespace

const NcclApi* LoadNccl(std::string* error) {
  if (const NcclApi* api = g_loaded.load(std::memory_order_acquire)) return api;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (const NcclApi* api = g_loaded.load(std::memory_order_acquire)) return api;
  std::unique_ptr<NcclApi> api = Load(error);
  if (api == nullptr) return nullptr;
  const NcclApi* raw = api.release();  // intentionally never freed
  g_loaded.store(raw, std::memory_order_release);
  return raw;
}

const NcclApi* LoadedNccl() { return g_loaded.load(std::memory_order_acquire); }

std::string NcclErrorMessage(const NcclApi& nccl, const char* call,
                             ncclResult_t result, ncclComm_t comm) {
  std::string msg = std::string(call) + " failed: " + nccl.GetErrorString(result) + " (ncclResult " +
                    std::to_string(static_cast<int>(result)) + ")";
  if (nccl.GetLastError != nullptr) {  // a null comm asks for the last global error
    const char* last = nccl.GetLastError(comm);
    if (last != nullptr && last[0] != '\0') msg += std::string(": ") + last;
  }
  return msg;
}

ncclResult_t SettleNccl(const NcclApi& nccl, ncclComm_t comm, ncclResult_t result) {
  while (result == ncclInProgress) {
    sched_yield();
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = nccl.CommGetAsyncError(comm, &state);
    result = q != ncclSuccess ? q : state;
  }
  return result;
}

std::string CommRank(const NcclApi& nccl, ncclComm_t comm, int64_t group_size, int* rank) {
  int count = 0;
  if (ncclResult_t r = nccl.CommCount(comm, &count); r != ncclSuccess) {
    return NcclErrorMessage(nccl, "ncclCommCount", r, comm);
  }
  if (count != group_size) {
    return "XLA's communicator has " + std::to_string(count) + " ranks but group_size is " +
           std::to_string(group_size);
  }
  if (ncclResult_t r = nccl.CommUserRank(comm, rank); r != ncclSuccess) {
    return NcclErrorMessage(nccl, "ncclCommUserRank", r, comm);
  }
  if (*rank < 0 || *rank >= count) {
    return "ncclCommUserRank gave rank " + std::to_string(*rank) + " of " + std::to_string(count);
  }
  return std::string();
}

}  // namespace moe_jax::cuda

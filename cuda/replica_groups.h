// The `replica_groups` attribute of the collective handlers (NCCL and FAST
// all-to-all, the NVLink transport across processes), parsed once per
// distinct value into the layout of XLA's FFI collectives extension.
#ifndef MOE_JAX_CUDA_REPLICA_GROUPS_H_
#define MOE_JAX_CUDA_REPLICA_GROUPS_H_

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/collectives_c_api.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_checks.h"

namespace moe_jax::cuda {

// One distinct (replica_groups, group_size) value. Never freed (a process
// sees few distinct values: one per compiled collective configuration), so
// `views` stays valid for the life of the process.
struct ReplicaGroups {
  int64_t group_size = 0;
  std::vector<int64_t> ids;                 // the attribute, flattened
  std::vector<XLA_FFI_ReplicaGroup> views;  // group g: ids[g * group_size ...]

  bool Matches(xla::ffi::Span<const int64_t> flat, int64_t size) const {
    return group_size == size && ids.size() == flat.size() &&
           (flat.size() == 0 ||
            std::memcmp(ids.data(), flat.begin(), flat.size() * sizeof(int64_t)) == 0);
  }
};

// Parses the attribute pair of a collective custom call:
//   replica_groups: i64[G * group_size], G >= 1 groups of device ids
//                   (flattened ids: with one replica, partition ids, i.e.
//                   positions in the mesh's device order), each group in
//                   rank order, all flattened into one array;
//   group_size:     i64 in [1, 2^31).
// Returns the validated groups (ids non-negative and distinct), whose
// `views` are what CollectivesContext's RequestFlattened / GetFlattened
// take, or INVALID_ARGUMENT naming `call` and the attribute.
//
// Each distinct value is validated once and cached: the fast path (the value
// of this thread's previous call) takes no lock and does no heap work; a
// miss locks a mutex and searches the (short) list.
inline xla::ffi::ErrorOr<const ReplicaGroups*> ParseReplicaGroups(
    xla::ffi::Span<const int64_t> flat, int64_t group_size, const ffi_checks::CustomCall& call) {
  thread_local const ReplicaGroups* last = nullptr;
  if (last != nullptr && last->Matches(flat, group_size)) return last;

  static std::mutex mu;
  static auto* cache = new std::vector<std::unique_ptr<ReplicaGroups>>();
  std::lock_guard<std::mutex> lock(mu);
  for (const std::unique_ptr<ReplicaGroups>& g : *cache) {
    if (g->Matches(flat, group_size)) {
      last = g.get();
      return last;
    }
  }

  if (group_size < 1 || group_size > INT_MAX) {
    return ffi_checks::BadAttr(call, "group_size", group_size, "in [1, 2^31)");
  }
  const size_t n = flat.size();
  if (n == 0 || n % static_cast<size_t>(group_size) != 0) {
    return ffi_checks::Invalid(
        call, "attribute `replica_groups` must hold G >= 1 groups of group_size = " +
                  std::to_string(group_size) + " ids, flattened; got " + std::to_string(n) +
                  " ids");
  }
  std::vector<int64_t> sorted(flat.begin(), flat.end());
  std::sort(sorted.begin(), sorted.end());
  if (sorted.front() < 0) {
    return ffi_checks::Invalid(
        call, "attribute `replica_groups` holds a negative id " + std::to_string(sorted.front()));
  }
  if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
    return ffi_checks::Invalid(
        call, "attribute `replica_groups` names id " + std::to_string(*dup) + " more than once");
  }

  auto groups = std::make_unique<ReplicaGroups>();
  groups->group_size = group_size;
  groups->ids.assign(flat.begin(), flat.end());
  const size_t size = static_cast<size_t>(group_size);
  groups->views.reserve(n / size);
  for (size_t g = 0; g < n; g += size) {
    groups->views.push_back(XLA_FFI_ReplicaGroup{groups->ids.data() + g, size});
  }
  cache->push_back(std::move(groups));
  last = cache->back().get();
  return last;
}

}  // namespace moe_jax::cuda

#endif  // MOE_JAX_CUDA_REPLICA_GROUPS_H_

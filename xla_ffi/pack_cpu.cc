#include "xla_ffi/pack_cpu.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace moe_jax::cpu {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

// Fills rows [0, rows) of one destination's buffer from stream positions
// first_pos, first_pos + 1, ...; `valid` of them exist, the rest are zeros.
std::string FillRows(const PackArgs& a, int64_t p, int64_t first_pos,
                     int64_t rows, int64_t valid, char* out) {
  const int64_t n_slots = a.num_tokens * a.top_k;
  const char* x = static_cast<const char*>(a.x);
  const size_t rb = static_cast<size_t>(a.row_bytes);
  // Only used when valid > 0, i.e. first_pos < send_counts[p].
  const int64_t base =
      valid > 0 ? static_cast<int64_t>(a.send_offsets[p]) + first_pos : 0;
  for (int64_t c = 0; c < valid; ++c) {
    const int32_t slot = a.sorted_slots[base + c];
    if (slot < 0 || slot >= n_slots) {
      return "sorted_slots[" + Str(base + c) + "] = " + Str(slot) +
             " is outside [0, N=" + Str(n_slots) + ")";
    }
    if (rb != 0) {
      std::memcpy(out + c * rb, x + (slot / a.top_k) * rb, rb);
    }
  }
  if (rows > valid && rb != 0) {
    std::memset(out + valid * rb, 0, static_cast<size_t>(rows - valid) * rb);
  }
  return {};
}

}  // namespace

std::string Pack(const PackArgs& a) {
  if (a.top_k < 1) return "top_k must be >= 1, got " + Str(a.top_k);
  if (a.start < 0) return "start must be >= 0, got " + Str(a.start);
  if (a.capacity < 0) return "capacity must be >= 0, got " + Str(a.capacity);
  if (a.spill_capacity < 0) {
    return "spill_capacity must be >= 0, got " + Str(a.spill_capacity);
  }
  const int64_t n_slots = a.num_tokens * a.top_k;
  for (int64_t p = 0; p < a.num_ranks; ++p) {
    const int64_t off = a.send_offsets[p];
    const int64_t cnt = a.send_counts[p];
    if (off < 0 || cnt < 0 || off + cnt > n_slots) {
      return "stream of destination " + Str(p) + " (send_offsets[" + Str(p) +
             "] = " + Str(off) + ", send_counts[" + Str(p) + "] = " +
             Str(cnt) + ") is outside [0, N=" + Str(n_slots) + ")";
    }
  }
  const size_t rb = static_cast<size_t>(a.row_bytes);
  char* cap = static_cast<char*>(a.cap_buf);
  char* spill = static_cast<char*>(a.spill_buf);
  for (int64_t p = 0; p < a.num_ranks; ++p) {
    // Positions [start, count) exist; no overflow since start >= 0 and
    // count fits in int32.
    const int64_t avail = std::max<int64_t>(0, a.send_counts[p] - a.start);
    const int64_t cap_valid = std::min(a.capacity, avail);
    const int64_t spill_valid =
        std::min(a.spill_capacity, std::max<int64_t>(0, avail - a.capacity));
    std::string err;
    if (a.capacity > 0) {
      err = FillRows(a, p, a.start, a.capacity, cap_valid,
                     cap + p * a.capacity * rb);
      if (!err.empty()) return err;
    }
    if (a.spill_capacity > 0) {
      // Only read when spill_valid > 0, i.e. start + capacity < count.
      const int64_t first = spill_valid > 0 ? a.start + a.capacity : 0;
      err = FillRows(a, p, first, a.spill_capacity, spill_valid,
                     spill + p * a.spill_capacity * rb);
      if (!err.empty()) return err;
    }
  }
  return {};
}

}  // namespace moe_jax::cpu

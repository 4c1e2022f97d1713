#include "xla_ffi/all_to_all_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <utility>
#include <vector>

namespace moe_jax::cpu {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

std::string RowType(const AllToAllArgs& a) {
  std::ostringstream os;
  os << a.dtype_name << "[";
  for (int64_t i = 0; i < a.row_rank; ++i) {
    os << (i ? "," : "") << a.row_dims[i];
  }
  os << "]";
  return os.str();
}

bool SameRowType(const AllToAllArgs& a, const AllToAllArgs& b) {
  return a.dtype == b.dtype && a.row_bytes == b.row_bytes &&
         a.row_rank == b.row_rank &&
         std::equal(a.row_dims, a.row_dims + a.row_rank, b.row_dims);
}

// Checks what one rank can check alone.
std::string LocalError(const AllToAllArgs& a) {
  for (int32_t p = 0; p < a.num_ranks; ++p) {
    const int64_t off = a.send_offsets[p], n = a.send_sizes[p];
    if (off < 0 || n < 0 || off + n > a.send_rows) {
      return "send_offsets[" + Str(p) + "] = " + Str(off) + ", send_sizes[" +
             Str(p) + "] = " + Str(n) + " address rows outside its send buffer "
             "[0, " + Str(a.send_rows) + ")";
    }
    const int64_t roff = a.recv_offsets[p];
    if (roff < 0 || roff > a.recv_rows) {
      return "recv_offsets[" + Str(p) + "] = " + Str(roff) +
             " is outside its recv buffer [0, " + Str(a.recv_rows) + "]";
    }
  }
  return {};
}

// Checks what needs every rank's plan. All ranks run it on the same data, so
// they reach the same verdict without another exchange.
std::string GlobalError(const std::vector<const AllToAllArgs*>& all) {
  const int32_t P = static_cast<int32_t>(all.size());
  for (int32_t q = 1; q < P; ++q) {
    if (!SameRowType(*all[q], *all[0])) {
      return "ranks disagree on the row type: rank " + Str(q) + " has " +
             RowType(*all[q]) + " rows, rank 0 has " + RowType(*all[0]);
    }
  }
  for (int32_t dst = 0; dst < P; ++dst) {
    const AllToAllArgs& d = *all[dst];
    for (int32_t src = 0; src < P; ++src) {
      const int64_t n = all[src]->send_sizes[dst];
      const int64_t off = d.recv_offsets[src];
      if (off + n > d.recv_rows) {
        return "rank " + Str(dst) + " would receive " + Str(n) +
               " rows from rank " + Str(src) + " at recv_offsets[" + Str(src) +
               "] = " + Str(off) + ", past the end of its recv buffer (" +
               Str(d.recv_rows) + " rows)";
      }
    }
  }
  return {};
}

// Copies the rows addressed to this rank and zeros the rows nobody writes.
// Sources are copied in decreasing rank order, so where the windows of two
// sources overlap the lower source's row wins (as in moe_jax/refs.py).
void CopyRows(const AllToAllArgs& me, const std::vector<const AllToAllArgs*>& all) {
  const size_t rb = static_cast<size_t>(me.row_bytes);
  char* recv = static_cast<char*>(me.recv);
  std::vector<std::pair<int64_t, int64_t>> written;  // [begin, end) rows
  for (size_t src = all.size(); src-- > 0;) {
    const AllToAllArgs& s = *all[src];
    const int64_t n = s.send_sizes[me.rank];
    me.recv_sizes[src] = static_cast<int32_t>(n);
    if (n == 0) continue;
    const int64_t from = s.send_offsets[me.rank];
    const int64_t to = me.recv_offsets[src];
    if (rb != 0) {
      std::memcpy(recv + to * rb, static_cast<const char*>(s.send) + from * rb,
                  static_cast<size_t>(n) * rb);
    }
    written.emplace_back(to, to + n);
  }
  if (rb == 0) return;
  std::sort(written.begin(), written.end());
  int64_t next = 0;  // rows [0, next) are covered or zeroed
  for (const auto& [b, e] : written) {
    if (b > next) std::memset(recv + next * rb, 0, (b - next) * rb);
    next = std::max(next, e);
  }
  if (me.recv_rows > next) {
    std::memset(recv + next * rb, 0, (me.recv_rows - next) * rb);
  }
}

}  // namespace

std::string AllToAll(const AllToAllArgs& a, double timeout_s,
                     Rendezvous& rendezvous) {
  std::string local = LocalError(a);
  if (a.num_ranks == 1 && a.rank == 0) {  // nobody to meet
    if (!local.empty()) return local;
    std::vector<const AllToAllArgs*> all{&a};
    std::string err = GlobalError(all);
    if (!err.empty()) return err;
    CopyRows(a, all);
    return {};
  }
  Rendezvous::Arrival arrival;
  arrival.key = a.key;
  arrival.rank = a.rank;
  arrival.num_ranks = a.num_ranks;
  arrival.device = a.device;
  arrival.payload = &a;
  arrival.local_error = std::move(local);
  Rendezvous::Ticket ticket;
  std::vector<const void*> payloads;
  std::string err = rendezvous.Join(arrival, timeout_s, &ticket, &payloads);
  if (!err.empty()) return err;
  std::vector<const AllToAllArgs*> all(payloads.size());
  for (size_t i = 0; i < payloads.size(); ++i) {
    all[i] = static_cast<const AllToAllArgs*>(payloads[i]);
  }
  err = GlobalError(all);
  if (err.empty()) {
    CopyRows(a, all);
  } else {
    err += " (channel_id=" + Str(a.key.channel_id) + " group_key=" +
           Str(a.key.group_key) + " call #" + Str(ticket.sequence()) +
           " of run_id=" + Str(a.key.run_id) + ")";
  }
  // Always wait, so no peer's send buffer is released while it is read.
  std::string finish = rendezvous.Finish(&ticket, timeout_s);
  return err.empty() ? finish : err;
}

double AllToAllTimeoutFromEnv() {
  constexpr double kDefault = 300.0;
  const char* s = std::getenv("MOE_JAX_CPU_A2A_TIMEOUT_S");
  if (s == nullptr || *s == '\0') return kDefault;
  char* end = nullptr;
  const double v = std::strtod(s, &end);
  if (end == s || !std::isfinite(v) || v <= 0) return kDefault;
  return v;
}

}  // namespace moe_jax::cpu

#include "xla_ffi/fast/scheduler.h"

#include <algorithm>
#include <cstring>

namespace moe_jax::fast {
namespace {

// Writes one transfer row at w; returns the slot after it.
inline int64_t* PutRow(int64_t* w, int64_t stage, int64_t src, int64_t dst,
                       int64_t amount, int64_t flow_src, int64_t flow_dst) {
  w[kStage] = stage;
  w[kSrc] = src;
  w[kDst] = dst;
  w[kAmount] = amount;
  w[kFlowSrc] = flow_src;
  w[kFlowDst] = flow_dst;
  return w + kTransferCols;
}

// Makes v hold at least `need` elements, doubling (values past the old size
// are overwritten by the caller).
template <typename T>
inline T* GrowTo(std::vector<T>* v, size_t need) {
  if (v->size() < need) v->resize(std::max(need, 2 * v->size()));
  return v->data();
}

}  // namespace

// lane_units[s, b]: GPU s's units for server b (the M entries of its row
// in tile (s / M, b)); D[a, b]: their sum over the GPUs of a, zero
// diagonal.  Returns the OR of all entries (negative iff one of them is).
template <int M>
static int64_t TileRowSums(const int64_t* __restrict traffic, int n, int m,
                           int64_t* __restrict units) {
  const int mm = M > 0 ? M : m;
  const int64_t g = static_cast<int64_t>(n) * mm;
  int64_t any_sign = 0;
  for (int64_t s = 0; s < g; ++s) {
    const int64_t* __restrict row = traffic + s * g;
    int64_t* __restrict u = units + s * n;
    for (int b = 0; b < n; ++b) {
      const int64_t* __restrict t = row + static_cast<int64_t>(b) * mm;
      int64_t sum = 0, sign = 0;
      for (int h = 0; h < mm; ++h) {
        sum += t[h];
        sign |= t[h];
      }
      u[b] = sum;
      any_sign |= sign;
    }
  }
  return any_sign;
}

int64_t FastScheduler::ServerMatrix(const int64_t* traffic,
                                    FastSchedule* out) {
  const int n = n_, m = m_;
  const int64_t g = static_cast<int64_t>(n) * m;
  out->server.resize(static_cast<size_t>(n) * n);
  out->lane_units.resize(static_cast<size_t>(g) * n);
  int64_t* __restrict units = out->lane_units.data();
  units_ = units;
  const int64_t any_sign =
      m == 8 ? TileRowSums<8>(traffic, n, m, units)
             : (m == 4 ? TileRowSums<4>(traffic, n, m, units)
                       : TileRowSums<0>(traffic, n, m, units));
  for (int a = 0; a < n; ++a) {
    int64_t* __restrict drow = out->server.data() + static_cast<int64_t>(a) * n;
    const int64_t* __restrict u = units + static_cast<int64_t>(a) * m * n;
    for (int b = 0; b < n; ++b) drow[b] = u[b];
    for (int i = 1; i < m; ++i) {
      const int64_t* __restrict ui = u + static_cast<int64_t>(i) * n;
      for (int b = 0; b < n; ++b) drow[b] += ui[b];
    }
    drow[a] = 0;
  }
  return any_sign;
}

// Greedy padding to equal row/column sums (rows, then columns, in order);
// sets out->bound and out->padded.
void FastScheduler::Pad(FastSchedule* out) {
  const int n = n_;
  remaining_.assign(2 * static_cast<size_t>(n), 0);  // row, col deficits
  int64_t* dr = remaining_.data();
  int64_t* dc = dr + n;
  const int64_t* d = out->server.data();
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      const int64_t x = d[static_cast<int64_t>(a) * n + b];
      dr[a] += x;
      dc[b] += x;
    }
  }
  int64_t big = 0;
  for (int a = 0; a < 2 * n; ++a) big = std::max(big, dr[a]);
  out->bound = big;
  for (int a = 0; a < 2 * n; ++a) dr[a] = big - dr[a];
  out->padded = out->server;
  for (int i = 0, j = 0; i < n; ++i) {
    while (dr[i] > 0) {
      while (dc[j] == 0) ++j;
      const int64_t x = std::min(dr[i], dc[j]);
      out->padded[static_cast<int64_t>(i) * n + j] += x;
      dr[i] -= x;
      dc[j] -= x;
    }
  }
}

// Matches row to col.  The row's previous entry (if any) gets its lazy
// residual back; the new entry's residual becomes the row's key.
void FastScheduler::Rematch(int row, int col, int64_t cum) {
  const int64_t base = static_cast<int64_t>(row) * n_;
  const int old = match_row_[row];
  if (old >= 0) residual_[base + old] = key_[row] - cum;
  match_row_[row] = col;
  match_col_[col] = row;
  key_[row] = residual_[base + col] + cum;
  on_padding_[row] = real_left_[base + col] < residual_[base + col];
}

// Breadth-first search for a shortest augmenting path from free row u
// (rows dequeued in order, columns scanned in increasing order); flips it.
// Columns are scanned through the support bitsets: support_ & ~seen_.
bool FastScheduler::Augment(int u, int64_t cum) {
  if (words_ == 1) return AugmentOneWord(u, cum);
  const int words = words_;
  uint64_t* seen = seen_.data();
  std::memset(seen, 0, sizeof(uint64_t) * words);
  int head = 0, tail = 0;
  queue_[tail++] = u;
  while (head < tail) {
    const int r = queue_[head++];
    const uint64_t* sup = support_.data() + static_cast<size_t>(r) * words;
    for (int w = 0; w < words; ++w) {
      uint64_t bits = sup[w] & ~seen[w];
      seen[w] |= bits;
      while (bits != 0) {
        const int v = w * 64 + __builtin_ctzll(bits);
        bits &= bits - 1;
        prev_[v] = r;
        if (match_col_[v] < 0) {
          FlipPath(u, v, cum);
          return true;
        }
        queue_[tail++] = match_col_[v];
      }
    }
  }
  return false;
}

// Augment for n <= 64: the columns reached are one word.
bool FastScheduler::AugmentOneWord(int u, int64_t cum) {
  const uint64_t* support = support_.data();
  const int* match_col = match_col_.data();
  int* queue = queue_.data();
  int* prev = prev_.data();
  uint64_t seen = 0;
  int head = 0, tail = 0;
  queue[tail++] = u;
  while (head < tail) {
    const int r = queue[head++];
    uint64_t bits = support[r] & ~seen;
    seen |= bits;
    while (bits != 0) {
      const int v = __builtin_ctzll(bits);
      bits &= bits - 1;
      prev[v] = r;
      if (match_col[v] < 0) {
        FlipPath(u, v, cum);
        return true;
      }
      queue[tail++] = match_col[v];
    }
  }
  return false;
}

// Flips the augmenting path from free row u that ends at free column v.
void FastScheduler::FlipPath(int u, int v, int64_t cum) {
  for (int c = v;;) {
    const int pr = prev_[c];
    const int old = match_row_[pr];
    Rematch(pr, c, cum);
    if (pr == u) return;
    c = old;
  }
}

// Integer Birkhoff-von Neumann decomposition of out->padded into
// out->matchings / weights, with out->real (real units per stage).
bool FastScheduler::Decompose(FastSchedule* out) {
  const int n = n_;
  const size_t nn = static_cast<size_t>(n) * n;
  words_ = (n + 63) / 64;
  // Sized once per n; every entry is set below (one pass, not an assign
  // call per array).
  residual_.resize(nn);
  real_left_.resize(nn);
  key_.resize(n);
  on_padding_.resize(n);
  match_row_.resize(n);
  match_col_.resize(n);
  seen_.resize(words_);
  support_.resize(static_cast<size_t>(n) * words_);
  prev_.resize(n);
  queue_.resize(n);
  freed_.resize(n);
  std::memcpy(residual_.data(), out->padded.data(), nn * sizeof(int64_t));
  std::memcpy(real_left_.data(), out->server.data(), nn * sizeof(int64_t));
  std::memset(support_.data(), 0, support_.size() * sizeof(uint64_t));
  for (int u = 0; u < n; ++u) {
    key_[u] = 0;
    on_padding_[u] = 0;
    match_row_[u] = -1;
    match_col_[u] = -1;
    prev_[u] = -1;
    queue_[u] = 0;
    freed_[u] = u;
    const int64_t* res = residual_.data() + static_cast<size_t>(u) * n;
    uint64_t* sup = support_.data() + static_cast<size_t>(u) * words_;
    for (int v = 0; v < n; ++v) {
      sup[v / 64] |= static_cast<uint64_t>(res[v] > 0) << (v % 64);
    }
  }
  int num_freed = n;
  const int64_t total = out->bound;
  int64_t cum = 0;  // weight subtracted so far
  int s = 0;
  while (cum < total) {
    for (int i = 0; i < num_freed; ++i) {
      // Always succeeds: the residual keeps equal row/column sums.
      if (!Augment(freed_[i], cum)) return false;
    }
    int64_t low = key_[0];
    for (int u = 1; u < n; ++u) low = std::min(low, key_[u]);
    const int64_t w = low - cum;
    const size_t row = static_cast<size_t>(s) * n;
    int64_t* match = GrowTo(&out->matchings, row + n) + row;
    int64_t* real = GrowTo(&out->real, row + n) + row;
    int32_t* inv = GrowTo(&inverse_, row + n) + row;
    GrowTo(&out->weights, s + 1)[s] = w;
    for (int u = 0; u < n; ++u) {
      match[u] = match_row_[u];
      inv[u] = match_col_[u];
      real[u] = w;
    }
    // Entries without padding carry w real units; padded ones what is left.
    for (int u = 0; u < n; ++u) {
      if (!on_padding_[u]) continue;
      int64_t& left = real_left_[static_cast<size_t>(u) * n + match_row_[u]];
      real[u] = std::min(w, left);
      left -= real[u];
    }
    cum = low;
    num_freed = 0;
    for (int u = 0; u < n; ++u) {
      if (key_[u] != low) continue;
      const int v = match_row_[u];
      residual_[static_cast<size_t>(u) * n + v] = 0;
      match_row_[u] = -1;
      match_col_[v] = -1;
      support_[static_cast<size_t>(u) * words_ + v / 64] &=
          ~(uint64_t{1} << (v % 64));
      freed_[num_freed++] = u;
    }
    ++s;
  }
  out->num_stages = s;
  out->matchings.resize(static_cast<size_t>(s) * n);
  out->real.resize(static_cast<size_t>(s) * n);
  out->weights.resize(s);
  return true;
}

// Runs the BvN stages in reference.stage_order's order: the stage with
// the fewest real units (largest over servers, in decomposition order)
// first, the others by descending size (stable); the stage run second is
// split into three parts of growing weight (reference.split_second_stage),
// then the real units are recomputed in that order (a pair's units first,
// its padding last).
void FastScheduler::OrderStages(FastSchedule* out) {
  const int n = n_, s = out->num_stages;
  if (s <= 1) return;
  order_size_.resize(s);
  for (int k = 0; k < s; ++k) {
    const int64_t* real = out->real.data() + static_cast<size_t>(k) * n;
    order_size_[k] = *std::max_element(real, real + n);
  }
  order_.resize(s);
  for (int k = 0; k < s; ++k) order_[k] = k;
  const int first = static_cast<int>(
      std::min_element(order_size_.begin(), order_size_.end()) -
      order_size_.begin());
  // Stable by size, descending (ties by index: no buffer to allocate).
  const auto before = [&](int x, int y) {
    return order_size_[x] > order_size_[y] ||
           (order_size_[x] == order_size_[y] && x < y);
  };
  if (s <= 16) {
    // Each stage's rank is the number of stages before it (a total
    // order): branch-free counting, no mispredicted sort steps.
    const int64_t* size = order_size_.data();
    for (int x = 0; x < s; ++x) {
      const int64_t sx = size[x];
      int rank = 0;
      for (int y = 0; y < x; ++y) rank += size[y] >= sx;
      for (int y = x + 1; y < s; ++y) rank += size[y] > sx;
      order_[rank] = x;
    }
  } else if (s <= 32) {
    for (int i = 1; i < s; ++i) {
      const int x = order_[i];
      int j = i;
      for (; j > 0 && before(x, order_[j - 1]); --j) order_[j] = order_[j - 1];
      order_[j] = x;
    }
  } else {
    std::sort(order_.begin(), order_.end(), before);
  }
  std::rotate(order_.begin(), std::find(order_.begin(), order_.end(), first),
              std::find(order_.begin(), order_.end(), first) + 1);
  const size_t sn = static_cast<size_t>(s) * n;
  scratch_match_.assign(out->matchings.begin(), out->matchings.begin() + sn);
  scratch_inv_.assign(inverse_.begin(), inverse_.begin() + sn);
  scratch_w_.assign(out->weights.begin(), out->weights.begin() + s);
  // Parts (stage, weight) in run order.
  Part* parts = GrowTo(&parts_, static_cast<size_t>(s) + 2);
  int s2 = 0;
  for (int i = 0; i < s; ++i) {
    const int64_t w = scratch_w_[order_[i]];
    if (i != 1) {
      parts[s2++] = {order_[i], w};
      continue;
    }
    int64_t done = 0;
    for (int64_t upto : {kSplitCum[0], kSplitCum[1], kSplitCum[2]}) {
      // 64-bit unless w * upto could overflow (no 128-bit division).
      int64_t to = w <= INT64_MAX / kSplitCum[2]
                       ? w * upto / kSplitCum[2]
                       : static_cast<int64_t>(static_cast<__int128>(w) *
                                              upto / kSplitCum[2]);
      if (upto != kSplitCum[2]) to -= to % m_;
      if (to > done) parts[s2++] = {order_[i], to - done};
      done = to;
    }
  }
  const size_t sn2 = static_cast<size_t>(s2) * n;
  GrowTo(&inverse_, sn2);
  out->matchings.resize(sn2);
  out->real.resize(sn2);
  out->weights.resize(s2);
  out->num_stages = s2;
  real_left_.assign(out->server.begin(), out->server.end());
  for (int i = 0; i < s2; ++i) {
    const size_t src = static_cast<size_t>(parts[i].stage) * n;
    const size_t dst = static_cast<size_t>(i) * n;
    const int64_t w = parts[i].weight;
    out->weights[i] = w;
    for (int u = 0; u < n; ++u) {
      const int64_t v = scratch_match_[src + u];
      out->matchings[dst + u] = v;
      inverse_[dst + u] = scratch_inv_[src + u];
      int64_t& left = real_left_[static_cast<size_t>(u) * n + v];
      const int64_t x = std::min(w, left);
      out->real[dst + u] = x;
      left -= x;
    }
  }
}

// The server-level part every schedule starts from (server matrix, padding,
// decomposition, stage order), with the transfer lists emptied.
std::string FastScheduler::ServerLevel(const int64_t* traffic, int num_servers,
                                       int gpus_per_server, int64_t gpu,
                                       FastSchedule* out) {
  if (num_servers < 1) return "num_servers must be >= 1";
  if (gpus_per_server < 1) return "gpus_per_server must be >= 1";
  n_ = num_servers;
  m_ = gpus_per_server;
  const int64_t g = static_cast<int64_t>(n_) * m_;
  if (gpu < -1 || gpu >= g) return "gpu must be -1 (all) or in [0, G)";
  gpu_ = gpu;
  out->num_servers = n_;
  out->gpus_per_server = m_;
  if (ServerMatrix(traffic, out) < 0) return "traffic must be non-negative";
  Pad(out);
  if (!Decompose(out)) return "internal error: no perfect matching";
  OrderStages(out);
  out->transfers.clear();
  out->redistribution.clear();
  return {};
}

std::string FastScheduler::Schedule(const int64_t* traffic, int num_servers,
                                    int gpus_per_server, bool with_transfers,
                                    FastSchedule* out, int64_t gpu) {
  if (with_transfers && gpu == -1) {
    if (std::string err =
            ScheduleRanges(traffic, num_servers, gpus_per_server, out);
        !err.empty()) {
      return err;
    }
    ExpandRows(traffic, out);
    return {};
  }
  if (std::string err = ServerLevel(traffic, num_servers, gpus_per_server, gpu, out);
      !err.empty()) {
    return err;
  }
  out->pair_sent.clear();
  out->balance_begin.clear();
  out->rows = with_transfers;
  if (with_transfers) BuildTransfers(traffic, out);
  return {};
}

std::string FastScheduler::ScheduleRanges(const int64_t* traffic,
                                          int num_servers,
                                          int gpus_per_server,
                                          FastSchedule* out) {
  if (std::string err = ServerLevel(traffic, num_servers, gpus_per_server, -1, out);
      !err.empty()) {
    return err;
  }
  const int n = n_, m = m_;
  out->rows = false;
  const size_t nn = static_cast<size_t>(n) * n;
  have_.resize(m);
  want_.resize(m);
  lanes_.resize(m);
  take_end_.resize(m + 1);
  take_dst_.resize(m);
  piece_end_.resize(static_cast<size_t>(m) * m + 1);
  piece_tag_.resize(static_cast<size_t>(m) * m);
  out->balance_begin.resize(nn + 1);
  int64_t* begin = out->balance_begin.data();
  const int64_t* d = out->server.data();
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      const size_t p = static_cast<size_t>(a) * n + b;
      begin[p] = static_cast<int64_t>(out->transfers.size()) / kTransferCols;
      if (a != b && d[p] > 0) BalanceRanges(traffic, a, b, d[p], &out->transfers);
    }
  }
  begin[nn] = static_cast<int64_t>(out->transfers.size()) / kTransferCols;
  PairSent(out);
  return {};
}

// pair_sent[k, a]: units of pair (a, matchings[k, a]) sent before stage k.
void FastScheduler::PairSent(FastSchedule* out) {
  const int n = n_, s = out->num_stages;
  sent_.assign(static_cast<size_t>(n) * n, 0);
  out->pair_sent.resize(static_cast<size_t>(s) * n);
  int64_t* sent = sent_.data();
  for (int k = 0; k < s; ++k) {
    const int64_t* match = out->matchings.data() + static_cast<size_t>(k) * n;
    const int64_t* real = out->real.data() + static_cast<size_t>(k) * n;
    int64_t* ps = out->pair_sent.data() + static_cast<size_t>(k) * n;
    for (int a = 0; a < n; ++a) {
      int64_t& x = sent[static_cast<size_t>(a) * n + match[a]];
      ps[a] = x;
      x += real[a];
    }
  }
}

// Lane queues from the ranges form (each lane's kept own pieces, then the
// balancing rows into it), the intra-server rows, then every stage's
// scale-out and redistribution rows.
void FastScheduler::ExpandRows(const int64_t* traffic, FastSchedule* out) {
  if (out->rows) return;
  const int n = n_ = out->num_servers, m = m_ = out->gpus_per_server;
  gpu_ = -1;
  units_ = out->lane_units.data();
  const int64_t g = static_cast<int64_t>(n) * m;
  const size_t nn = static_cast<size_t>(n) * n;
  qbeg_.resize(nn * m);
  pair_size_.assign(nn, 0);
  have_.resize(m);
  want_.resize(m);
  const int64_t* bal = out->transfers.data();
  int64_t used = 0;
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      const size_t p = static_cast<size_t>(a) * n + b;
      const int64_t big = out->server[p];
      if (a == b || big == 0) continue;
      LaneShares<0>(a, b, big);
      int64_t r = out->balance_begin[p];
      const int64_t r_end = out->balance_begin[p + 1];
      Piece* pool = GrowTo(&pool_, used + static_cast<size_t>(m) * m +
                                       (r_end - r));
      Piece* at = pool + used;
      const int64_t* tile0 = traffic + static_cast<int64_t>(a) * m * g +
                             static_cast<int64_t>(b) * m;
      for (int l = 0; l < m; ++l) {
        const int64_t lane = static_cast<int64_t>(a) * m + l;
        qbeg_[p * m + l] = at - pool;
        at = PutKeptPieces(tile0 + l * g, l, static_cast<int32_t>(lane),
                           static_cast<int32_t>(b * m),
                           std::min(have_[l], want_[l]), at);
        for (; r < r_end && bal[r * kTransferCols + kDst] == lane; ++r) {
          const int64_t* row = bal + r * kTransferCols;
          *at++ = {static_cast<int32_t>(row[kFlowSrc]),
                   static_cast<int32_t>(row[kFlowDst]), row[kAmount]};
        }
      }
      pair_size_[p] = at - pool - used;
      used = at - pool;
    }
  }
  pool_used_ = used;
  BuildIntra(traffic, &out->transfers);
  sent_.assign(nn, 0);
  for (int k = 0; k < out->num_stages; ++k) EmitStageRows(k, out);
  out->rows = true;
}

// have_[i]: GPU a*M+i's units for server b (lane_units); want_[l]: units
// u < big with (u + a + b) % m == l, the lane's share. M > 0: m as a
// compile-time constant (no division by a variable); 0: m_.
template <int M>
void FastScheduler::LaneShares(int a, int b, int64_t big) {
  const int m = M > 0 ? M : m_, n = n_;
  const int64_t* units = units_ + static_cast<int64_t>(a) * m * n + b;
  for (int i = 0; i < m; ++i) have_[i] = units[static_cast<int64_t>(i) * n];
  const int off = (a + b) % m;
  const int64_t q = big / m;
  const int rem = static_cast<int>(big % m);
  for (int l = 0; l < m; ++l) {
    int d = l - off;
    d += m & (d >> 31);
    want_[l] = q + (d < rem ? 1 : 0);
  }
}

// Balancing of server pair (a, b), D[a, b] = big: GPU i's pieces for server
// b in tile order; givers (more than their share) hand their tail pieces to
// receivers, both in increasing lane order (so the rows go to receiving
// lanes in non-decreasing order).  Writes the pair's balancing rows to
// `rows`; the lane queues stay implicit (FastSchedule's ranges form).
// The givers' tails (giver order, each from its last column down: its
// queue is columns i, i + 1, .. mod m) form one stream of non-empty pieces
// and the receivers' deficits (lane order) split it; both are laid out
// first as cumulative ends (independent per lane, branch-free), so the
// merge that writes a row per overlap is a short dependent chain.
template <int M>
void FastScheduler::BalanceRangesM(const int64_t* traffic, int a, int b,
                                   int64_t big, RowBuffer* rows) {
  const int n = n_, m = M > 0 ? M : m_;
  const int64_t g = static_cast<int64_t>(n) * m;
  LaneShares<M>(a, b, big);
  const int64_t src0 = static_cast<int64_t>(a) * m;
  const int64_t dst0 = static_cast<int64_t>(b) * m;
  // Receivers' cumulative deficits and lanes, givers in lane order.
  int64_t* __restrict qend = take_end_.data();
  int64_t* __restrict qdst = take_dst_.data();
  int* __restrict givers = lanes_.data();
  int ng = 0, nt = 0;
  int64_t total = 0, taken = 0;
  for (int i = 0; i < m; ++i) {
    const int64_t e = have_[i] - want_[i];
    const int64_t give = e > 0 ? e : 0, take = e < 0 ? -e : 0;
    taken += take;
    qend[nt] = taken;
    qdst[nt] = src0 + i;
    nt += e < 0;
    givers[ng] = i;
    ng += e > 0;
    total += give;
  }
  if (total == 0) return;
  // The stream: each giver's last pieces (from column i - 1 down) until its
  // excess is covered, empty pieces left out.
  int64_t* __restrict pend = piece_end_.data();
  int64_t* __restrict ptag = piece_tag_.data();  // lane << 32 | column
  const int64_t* tile0 = traffic + src0 * g + dst0;
  int np = 0;
  int64_t pos = 0;
  for (int k = 0; k < ng; ++k) {
    const int i = givers[k];
    const int64_t* __restrict tile = tile0 + i * g;
    const int64_t give = have_[i] - want_[i];
    // Arithmetic, not branches: the sizes are data.  A piece ends the
    // stream at pos + min(cum, give) (cum: the tail's units up to it) and
    // is non-empty iff that end moves.
    int64_t cum = 0, end = pos;
    const int64_t top = pos + give;
    const auto steps = [&](int from, int to) {
      for (int step = from; step < to; ++step) {
        int h = i - 1 - step;
        if constexpr (M > 0 && (M & (M - 1)) == 0) {
          h &= M - 1;
        } else {
          h += m & (h >> 31);
        }
        cum += tile[h];
        const int64_t over = cum - give;
        const int64_t next = top + (over & (over >> 63));
        pend[np] = next;
        ptag[np] = static_cast<int64_t>(i) << 32 | h;
        np += next > end;
        end = next;
      }
    };
    // Half the tail first: it mostly covers the excess (a well-predicted
    // branch then skips the rest).
    const int half = (m + 1) / 2;
    steps(0, half);
    if (cum < give) steps(half, m);
    pos += give;
  }
  // At most one row per piece plus one per receiver.
  int64_t* w = rows->Reserve(static_cast<size_t>(np + nt) * kTransferCols);
  // The next end of each list is loaded a row ahead and taken with a
  // mask, so the chain from one row to the next is a compare, not a load.
  pend[np] = total;  // read ahead past the end, never used
  qend[nt] = total;
  int64_t cur = 0;
  int pi = 0, ti = 0;
  int64_t pe = pend[0], qe = qend[0];
  while (cur < total) {
    const int64_t pn = pend[pi + 1], qn = qend[ti + 1];
    const int64_t e = std::min(pe, qe);
    w[kStage] = 0;
    const int64_t tag = ptag[pi];
    w[kSrc] = src0 + (tag >> 32);
    w[kDst] = qdst[ti];
    w[kAmount] = e - cur;
    w[kFlowSrc] = src0 + (tag >> 32);
    w[kFlowDst] = dst0 + (tag & 0xffffffff);
    w += kTransferCols;
    cur = e;
    const int64_t p_done = -static_cast<int64_t>(pe == e);
    const int64_t q_done = -static_cast<int64_t>(qe == e);
    pi -= static_cast<int>(p_done);
    ti -= static_cast<int>(q_done);
    pe ^= (pe ^ pn) & p_done;
    qe ^= (qe ^ qn) & q_done;
  }
  rows->Commit(w);
}

void FastScheduler::BalanceRanges(const int64_t* traffic, int a, int b,
                                  int64_t big, RowBuffer* rows) {
  if (m_ == 8) return BalanceRangesM<8>(traffic, a, b, big, rows);
  if (m_ == 4) return BalanceRangesM<4>(traffic, a, b, big, rows);
  BalanceRangesM<0>(traffic, a, b, big, rows);
}

// Balancing of a pair of gpu_'s server for gpu_ alone (same rows and, for
// gpu_'s lane, the same queue as BalancePair).  The givers' tails, taken in
// giver order and each from its last piece on, form one stream that the
// receivers split in lane order; positions in it follow from the lanes'
// excesses and deficits, so only the parts gpu_ needs are walked.  Rows:
// the balancing rows gpu_ sends or receives (pairs from gpu_'s server).
// Lane queue: gpu_'s lane only.  On pairs into gpu_'s server, the other
// lanes keep only the positions of their units for gpu_ (targets_), which
// the scale-out forwards to it.
void FastScheduler::BalancePairForGpu(const int64_t* traffic, int a, int b,
                                      int64_t big, RowBuffer* rows) {
  const int n = n_, m = m_;
  const int64_t g = static_cast<int64_t>(n) * m;
  const int gs = static_cast<int>(gpu_ / m), gl = static_cast<int>(gpu_ % m);
  const bool into = b == gs;
  const int64_t* tile0 = traffic + static_cast<int64_t>(a) * m * g +
                         static_cast<int64_t>(b) * m;
  LaneShares<0>(a, b, big);
  const size_t lane0 = (static_cast<size_t>(a) * n + b) * m;
  Piece* pool =
      GrowTo(&pool_, pool_used_ + 2 * static_cast<size_t>(m) * m + 2 * m);
  const int64_t start = pool_used_;
  Piece* at = PutKeptPieces(tile0 + gl * g, gl, a * m + gl, b * m,
                            std::min(have_[gl], want_[gl]), pool + start);
  int64_t* w = rows->Reserve(static_cast<size_t>(m * m + 2 * m) *
                             kTransferCols);
  const StreamPair pair{tile0, g, a, b};
  if (have_[gl] < want_[gl]) {
    at = ReceiveSegment(pair, !into, &w, at);
  } else if (have_[gl] > want_[gl] && !into) {
    w = GiveTail(pair, w);
  }
  rows->Commit(w);
  if (into) {
    FirstTargets(tile0, a);
    StreamTargets(pair);
  }
  qbeg_[lane0 + gl] = start;
  pool_used_ = at - pool;
  pair_size_[static_cast<size_t>(a) * n + b] = pool_used_ - start;
}

// Lane gpu_lane_ is a receiver: its segment of the stream, as pieces of
// its queue at `at` and, with `with_rows`, as balancing rows into gpu_.
FastScheduler::Piece* FastScheduler::ReceiveSegment(const StreamPair& p,
                                                    bool with_rows,
                                                    int64_t** w, Piece* at) {
  const int m = m_;
  const int gl = static_cast<int>(gpu_ % m);
  int64_t skip = 0;  // stream units before the segment
  for (int j = 0; j < gl; ++j) skip += std::max<int64_t>(want_[j] - have_[j], 0);
  int64_t need = want_[gl] - have_[gl];
  int64_t* row = *w;
  for (int i = 0; i < m && need > 0; ++i) {
    const int64_t excess = have_[i] - want_[i];
    if (excess <= 0) continue;
    if (skip >= excess) {
      skip -= excess;
      continue;
    }
    const int64_t* tile = p.tile0 + i * p.g;
    const int32_t src = p.a * m + i;
    int64_t left = excess;  // giver i's tail units from its last column down
    for (int t = 0, h = i == 0 ? m - 1 : i - 1; left > 0 && need > 0;
         ++t, h = h == 0 ? m - 1 : h - 1) {
      int64_t piece = std::min(tile[h], left);
      left -= piece;
      if (skip >= piece) {
        skip -= piece;
        continue;
      }
      piece -= skip;
      skip = 0;
      const int64_t y = std::min(piece, need);
      need -= y;
      const int32_t flow_dst = p.b * m + h;
      if (with_rows) row = PutRow(row, 0, src, gpu_, y, src, flow_dst);
      *at++ = {src, flow_dst, y};
    }
  }
  *w = row;
  return at;
}

// Lane gpu_lane_ is a giver: the balancing rows of its tail to the
// receivers whose segments it fills.
int64_t* FastScheduler::GiveTail(const StreamPair& p, int64_t* w) {
  const int m = m_;
  const int gl = static_cast<int>(gpu_ % m);
  int64_t pos = 0;  // stream position of gpu_'s tail
  for (int i = 0; i < gl; ++i) pos += std::max<int64_t>(have_[i] - want_[i], 0);
  int j = -1;
  int64_t seg_end = 0;  // end of receiver j's segment
  const int64_t* tile = p.tile0 + gl * p.g;
  int64_t left = have_[gl] - want_[gl];
  for (int h = gl == 0 ? m - 1 : gl - 1; left > 0;
       h = h == 0 ? m - 1 : h - 1) {
    int64_t piece = std::min(tile[h], left);
    left -= piece;
    while (piece > 0) {
      while (seg_end <= pos) {
        do ++j; while (have_[j] >= want_[j]);
        seg_end += want_[j] - have_[j];
      }
      const int64_t y = std::min(piece, seg_end - pos);
      piece -= y;
      pos += y;
      w = PutRow(w, 0, gpu_, p.a * m + j, y, gpu_, p.b * m + h);
    }
  }
  return w;
}

// Targets the other lanes receive: every giver's units for gpu_ that lie
// in its tail, split over the receivers' segments.
void FastScheduler::StreamTargets(const StreamPair& p) {
  const int m = m_;
  const int gl = static_cast<int>(gpu_ % m);
  Target* targets = targets_.data() + static_cast<size_t>(p.a) * m * m;
  int* count = target_count_.data() + static_cast<size_t>(p.a) * m;
  int64_t pos = 0;  // stream position of giver i's tail
  int j = -1;
  int64_t seg_begin = 0, seg_end = 0;  // receiver j's segment
  for (int i = 0; i < m; ++i) {
    const int64_t excess = have_[i] - want_[i];
    if (excess <= 0) continue;
    const int64_t* tile = p.tile0 + i * p.g;
    const int64_t after = have_[i] - before_[i] - tile[gl];  // columns > gl
    int64_t begin = pos + after;
    const int64_t end = pos + std::min(excess, after + tile[gl]);
    while (begin < end) {
      while (seg_end <= begin) {
        do ++j; while (have_[j] >= want_[j]);
        seg_begin = seg_end;
        seg_end += want_[j] - have_[j];
      }
      const int64_t stop = std::min(end, seg_end);
      if (j != gl) {
        const int64_t base = have_[j] - seg_begin;
        targets[j * m + count[j]++] = {base + begin, base + stop, p.a * m + i};
      }
      begin = stop;
    }
    pos += excess;
  }
}

// Writes the pieces of a lane's own row (flows flow_src -> dst0 + h) that
// it keeps, the first `keep` units; returns the slot after them.
FastScheduler::Piece* FastScheduler::PutKeptPieces(const int64_t* tile,
                                                   int lane, int32_t flow_src,
                                                   int32_t dst0, int64_t keep,
                                                   Piece* at) {
  for (int t = 0, h = lane; t < m_ && keep > 0;
       ++t, h = h + 1 == m_ ? 0 : h + 1) {
    const int64_t y = std::min(tile[h], keep);
    if (y > 0) *at++ = {flow_src, dst0 + h, y};
    keep -= y;
  }
  return at;
}

// Targets of pair (a, gpu_'s server) before balancing: each lane but
// gpu_'s keeps the first min(have, want) units of its row, among them
// (part of) its flow to gpu_.
void FastScheduler::FirstTargets(const int64_t* tile0, int a) {
  const int m = m_;
  const int64_t g = static_cast<int64_t>(n_) * m;
  const int gl = static_cast<int>(gpu_ % m);
  Target* targets = targets_.data() + static_cast<size_t>(a) * m * m;
  for (int l = 0; l < m; ++l) {
    const int64_t* tile = tile0 + l * g;
    const int64_t keep = std::min(have_[l], want_[l]);
    int64_t off = 0;  // lane l queues columns l, l + 1, .. (mod M)
    for (int h = l; h != gl; h = h + 1 == m ? 0 : h + 1) off += tile[h];
    before_[l] = off;
    const int64_t y = std::min(tile[gl], keep - off);
    const bool has = l != gl && y > 0;
    targets[l * m] = {off, off + y, a * m + l};
    target_count_[a * m + l] = has;
    target_next_[a * m + l] = 0;
    target_done_[a * m + l] = 0;
  }
}

// Intra-server part: T[s, h] for h != s on the same server (only gpu_'s
// server, and rows it sends or receives, when gpu_ >= 0).
void FastScheduler::BuildIntra(const int64_t* traffic, RowBuffer* rows) {
  const int m = m_;
  const int64_t g = static_cast<int64_t>(n_) * m;
  const int64_t only = gpu_;
  const int64_t s0 = only >= 0 ? only / m * m : 0;
  const int64_t s1 = only >= 0 ? s0 + m : g;
  int64_t* w = rows->Reserve(static_cast<size_t>(s1 - s0) * m * kTransferCols);
  for (int64_t s = s0; s < s1; ++s) {
    if (only >= 0 && s != only) {  // only s's flow into gpu_
      const int64_t x = traffic[s * g + only];
      if (x > 0) w = PutRow(w, 1, s, only, x, s, only);
      continue;
    }
    const int64_t base = (s / m) * m;
    for (int64_t h = base; h < base + m; ++h) {
      const int64_t x = traffic[s * g + h];
      if (h != s && x > 0) w = PutRow(w, 1, s, h, x, s, h);
    }
  }
  rows->Commit(w);
}

// Scale-out of x real units of pair (a, b) in BvN stage k: unit u of the
// pair goes through lane (u + a + b) % m, so every lane sends x / m units
// and the x % m lanes from the first unit's lane on one more.  Advances the
// pair's units sent.
FastScheduler::StageShare FastScheduler::TakeShare(int a, int b, int64_t x) {
  int64_t& sent = sent_[static_cast<size_t>(a) * n_ + b];
  const StageShare share{x / m_, static_cast<int>(x % m_),
                         static_cast<int>((sent + a + b) % m_)};
  sent += x;
  return share;
}

int64_t FastScheduler::StageShare::Units(int lane, int m) const {
  int d = lane - first_lane;
  if (d < 0) d += m;
  return q + (d < rem ? 1 : 0);
}

// Lane `lane` (a queue in pool_) sends its next c units from src to dst in
// BvN stage k: a scale-out row per piece (part) at w; with kRedistribute,
// its redistribution row (dst to the flow's destination) at r unless the
// flow is for dst.  Advances w and r.
template <bool kRedistribute>
inline void FastScheduler::WalkLane(size_t lane, int64_t c, int k,
                                    int64_t src, int64_t dst, int64_t*& w,
                                    int64_t*& r) {
  const int64_t stage = 2 + 2 * static_cast<int64_t>(k);
  Piece* pool = pool_.data();
  int64_t h = qbeg_[lane];
  auto put = [&](const Piece& p, int64_t y) {
    w = PutRow(w, stage, src, dst, y, p.flow_src, p.flow_dst);
    if (kRedistribute) {
      PutRow(r, stage + 1, dst, p.flow_dst, y, p.flow_src, p.flow_dst);
      r += p.flow_dst != dst ? kTransferCols : 0;
    }
  };
  // Whole pieces while they fit (h does not wait for the amounts), then
  // part of the next.
  while (c > 0 && pool[h].amount <= c) {
    c -= pool[h].amount;
    put(pool[h], pool[h].amount);
    ++h;
  }
  if (c > 0) {
    put(pool[h], c);
    pool[h].amount -= c;
  }
  qbeg_[lane] = h;
}

// Scale-out and redistribution rows of pair (a, b) in BvN stage k, every
// lane.
void FastScheduler::ScaleOutPair(int k, int a, int b, int64_t x,
                                 int64_t** tr, int64_t** red) {
  const int m = m_;
  const StageShare share = TakeShare(a, b, x);
  const size_t lane0 = (static_cast<size_t>(a) * n_ + b) * m;
  int64_t* w = *tr;
  int64_t* r = *red;
  for (int l = 0; l < m; ++l) {
    WalkLane<true>(lane0 + l, share.Units(l, m), k,
                   static_cast<int64_t>(a) * m + l,
                   static_cast<int64_t>(b) * m + l, w, r);
  }
  *tr = w;
  *red = r;
}

// Scale-out of pair (a, gpu_'s server) in BvN stage k for gpu_: its peer
// lane's rows (gpu_ receives them and forwards what is not its own), and,
// lane by lane, the redistribution rows that bring the other lanes' units
// for gpu_ (targets_) to it.
void FastScheduler::ScaleOutIntoGpu(int k, int a, int64_t x, int64_t** tr,
                                    int64_t** red) {
  const int m = m_;
  const int gs = static_cast<int>(gpu_ / m), gl = static_cast<int>(gpu_ % m);
  const StageShare share = TakeShare(a, gs, x);
  const size_t lane0 = (static_cast<size_t>(a) * n_ + gs) * m;
  const int64_t stage = 2 + 2 * static_cast<int64_t>(k);
  const Target* targets = targets_.data() + static_cast<size_t>(a) * m * m;
  for (int l = 0; l < m; ++l) {
    const int64_t c = share.Units(l, m);
    if (l == gl) {
      WalkLane<true>(lane0 + l, c, k, static_cast<int64_t>(a) * m + l, gpu_,
                     *tr, *red);
      continue;
    }
    const int lane = a * m + l;
    int t = target_next_[lane];
    const int count = target_count_[lane];
    if (t == count) continue;
    const int64_t begin = target_done_[lane], end = begin + c;
    target_done_[lane] = end;
    const int64_t peer = static_cast<int64_t>(gs) * m + l;
    int64_t* r = *red;
    for (; t < count && targets[l * m + t].begin < end; ++t) {
      const Target& u = targets[l * m + t];
      const int64_t y = std::min(u.end, end) - std::max(u.begin, begin);
      if (y > 0) r = PutRow(r, stage + 1, peer, gpu_, y, u.flow_src, gpu_);
      if (u.end > end) break;
    }
    *red = r;
    target_next_[lane] = t;
  }
}

// Scale-out and redistribution rows of BvN stage k (all pairs, or the two
// pairs of gpu_'s server with gpu_ >= 0), in sending-server order.
void FastScheduler::EmitStageRows(int k, FastSchedule* out) {
  const int n = n_, m = m_;
  const int64_t* match = out->matchings.data() + static_cast<size_t>(k) * n;
  const int64_t* real = out->real.data() + static_cast<size_t>(k) * n;
  RowBuffer& tr = out->transfers;
  RowBuffer& red = out->redistribution;
  // A pair's rows: at most one per piece it finishes plus one per lane,
  // and, into gpu_, one per target.
  auto reserve = [&](int a, int b, int64_t** w, int64_t** r) {
    const size_t most =
        (pair_size_[static_cast<size_t>(a) * n + b] + m * m + m) *
        kTransferCols;
    *w = tr.Reserve(most);
    *r = red.Reserve(most);
  };
  int64_t *w, *r;
  if (gpu_ >= 0) {
    const int gs = static_cast<int>(gpu_ / m), gl = static_cast<int>(gpu_ % m);
    const int b = static_cast<int>(match[gs]);
    const int a = inverse_[static_cast<size_t>(k) * n + gs];
    auto receive = [&] {
      if (a == gs || real[a] == 0) return;
      reserve(a, gs, &w, &r);
      ScaleOutIntoGpu(k, a, real[a], &w, &r);
      tr.Commit(w);
      red.Commit(r);
    };
    if (a < gs) receive();
    if (b != gs && real[gs] > 0) {  // sending pair: gpu_'s lane only
      reserve(gs, b, &w, &r);
      const StageShare share = TakeShare(gs, b, real[gs]);
      WalkLane<false>((static_cast<size_t>(gs) * n + b) * m + gl,
                      share.Units(gl, m), k, gpu_,
                      static_cast<int64_t>(b) * m + gl, w, r);
      tr.Commit(w);
    }
    if (a > gs) receive();
    return;
  }
  for (int a = 0; a < n; ++a) {
    // The pairs of a stage are scattered over the queues: fetch the lane
    // heads two servers ahead and their pieces one server ahead.
    if (a + 2 < n) {
      __builtin_prefetch(qbeg_.data() +
                         (static_cast<size_t>(a + 2) * n + match[a + 2]) * m);
    }
    if (a + 1 < n) {
      const int64_t* nb =
          qbeg_.data() + (static_cast<size_t>(a + 1) * n + match[a + 1]) * m;
      for (int l = 0; l < m; ++l) __builtin_prefetch(pool_.data() + nb[l]);
    }
    const int b = static_cast<int>(match[a]);
    if (real[a] == 0 || a == b) continue;
    reserve(a, b, &w, &r);
    ScaleOutPair(k, a, b, real[a], &w, &r);
    tr.Commit(w);
    red.Commit(r);
  }
}

// Per-GPU schedule (gpu_ >= 0): only the pairs of gpu_'s server (as
// source or destination) are balanced and expanded.
void FastScheduler::BuildTransfers(const int64_t* traffic, FastSchedule* out) {
  const int n = n_, m = m_;
  const int gs = static_cast<int>(gpu_ / m);
  const size_t nn = static_cast<size_t>(n) * n;
  qbeg_.resize(nn * m);
  pair_size_.resize(nn);
  pool_used_ = 0;
  have_.resize(m);
  want_.resize(m);
  before_.resize(m);
  const size_t lanes = static_cast<size_t>(n) * m;
  targets_.resize(lanes * m);
  target_count_.resize(lanes);
  target_next_.resize(lanes);
  target_done_.resize(lanes);

  // 1. Balancing and lane queues.
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      if (a == b || (a != gs && b != gs)) continue;
      const int64_t big = out->server[static_cast<size_t>(a) * n + b];
      BalancePairForGpu(traffic, a, b, big, &out->transfers);
    }
  }
  // 4. Intra-server part.
  BuildIntra(traffic, &out->transfers);
  // 2./3. Scale-out and redistribution per BvN stage; redistribution rows
  // go to out->redistribution so each stage is written in one pass.
  sent_.assign(nn, 0);
  for (int k = 0; k < out->num_stages; ++k) EmitStageRows(k, out);
}

// Workspace use per GPU from the ranges: a receiving lane j of pair (a, b)
// gets want - have balancing units; peer GPU b*M+l of lane l receives the
// lane's want units in scale-out and relays all but those for itself (its
// kept own units of column l, the first of its row, and the balancing rows
// into the lane for b*M+l).
void WorkspaceUseOfRanges(const int64_t* traffic, const FastSchedule& schedule,
                          std::vector<int64_t>* use) {
  const int n = schedule.num_servers, m = schedule.gpus_per_server;
  const int64_t g = static_cast<int64_t>(n) * m;
  use->assign(g, 0);
  if (m <= 1) return;
  int64_t* u = use->data();
  const int64_t* bal = schedule.transfers.data();
  const int64_t* units = schedule.lane_units.data();
  int64_t r = 0;  // balancing rows are the first rows (pairs in order)
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      const size_t p = static_cast<size_t>(a) * n + b;
      const int64_t big = schedule.server[p];
      if (a == b || big == 0) continue;
      const int64_t r_end = schedule.balance_begin[p + 1];
      const int off = (a + b) % m;
      const int64_t q = big / m;
      const int rem = static_cast<int>(big % m);
      for (int l = 0; l < m; ++l) {
        int dl = l - off;
        if (dl < 0) dl += m;
        const int64_t want = q + (dl < rem ? 1 : 0);
        const int64_t lane = static_cast<int64_t>(a) * m + l;
        const int64_t peer = static_cast<int64_t>(b) * m + l;
        const int64_t have = units[lane * n + b];
        const int64_t own = std::min(traffic[lane * g + peer],
                                     std::min(have, want));
        int64_t relay = want - own;
        if (want > have) u[lane] += want - have;
        for (; r < r_end && bal[r * kTransferCols + kDst] == lane; ++r) {
          if (bal[r * kTransferCols + kFlowDst] == peer) {
            relay -= bal[r * kTransferCols + kAmount];
          }
        }
        u[peer] += relay;
      }
    }
  }
}

int64_t SpreadOutTime(const int64_t* x, int n) {
  int64_t total = 0;
  for (int i = 1; i < n; ++i) {
    int64_t best = 0;
    for (int s = 0; s < n; ++s) {
      best = std::max(best, x[static_cast<int64_t>(s) * n + (s + i) % n]);
    }
    total += best;
  }
  return total;
}

}  // namespace moe_jax::fast

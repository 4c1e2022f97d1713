#include "xla_ffi/fast/scheduler.h"

#include <algorithm>

namespace moe_jax::fast {

// Breadth-first search for a shortest augmenting path from free row u
// (rows dequeued in order, columns scanned in increasing order); flips it.
// Columns are scanned through the support bitsets: support_ & ~seen_.
bool FastScheduler::Augment(int u) {
  const int words = words_;
  std::fill(seen_.begin(), seen_.end(), 0);
  int head = 0, tail = 0;
  queue_[tail++] = u;
  while (head < tail) {
    const int r = queue_[head++];
    const uint64_t* sup = support_.data() + static_cast<size_t>(r) * words;
    for (int w = 0; w < words; ++w) {
      uint64_t bits = sup[w] & ~seen_[w];
      seen_[w] |= bits;
      while (bits != 0) {
        const int v = w * 64 + __builtin_ctzll(bits);
        bits &= bits - 1;
        prev_[v] = r;
        if (match_col_[v] < 0) {
          for (int c = v;;) {
            const int pr = prev_[c];
            const int old = match_row_[pr];
            match_row_[pr] = c;
            match_col_[c] = pr;
            if (pr == u) return true;
            c = old;
          }
        }
        queue_[tail++] = match_col_[v];
      }
    }
  }
  return false;
}

bool FastScheduler::Decompose(FastSchedule* out) {
  const int n = n_;
  residual_.assign(out->padded.begin(), out->padded.end());
  match_row_.assign(n, -1);
  match_col_.assign(n, -1);
  words_ = (n + 63) / 64;
  seen_.assign(words_, 0);
  support_.assign(static_cast<size_t>(n) * words_, 0);
  for (int u = 0; u < n; ++u) {
    for (int v = 0; v < n; ++v) {
      if (residual_[static_cast<int64_t>(u) * n + v] > 0) {
        support_[static_cast<size_t>(u) * words_ + v / 64] |= uint64_t{1}
                                                               << (v % 64);
      }
    }
  }
  prev_.assign(n, -1);
  queue_.assign(n, 0);
  out->matchings.clear();
  out->weights.clear();
  int64_t total = 0;
  for (int v = 0; v < n; ++v) total += residual_[v];
  while (total > 0) {
    for (int u = 0; u < n; ++u) {
      if (match_row_[u] < 0) {
        // Always succeeds: the residual keeps equal row/column sums.
        if (!Augment(u)) return false;
      }
    }
    int64_t w = residual_[match_row_[0]];
    for (int u = 1; u < n; ++u) {
      w = std::min(w, residual_[static_cast<int64_t>(u) * n + match_row_[u]]);
    }
    for (int u = 0; u < n; ++u) out->matchings.push_back(match_row_[u]);
    out->weights.push_back(w);
    total -= w;
    for (int u = 0; u < n; ++u) {
      const int v = match_row_[u];
      int64_t& x = residual_[static_cast<int64_t>(u) * n + v];
      x -= w;
      if (x == 0) {
        match_row_[u] = -1;
        match_col_[v] = -1;
        support_[static_cast<size_t>(u) * words_ + v / 64] &=
            ~(uint64_t{1} << (v % 64));
      }
    }
  }
  out->num_stages = static_cast<int>(out->weights.size());
  return true;
}

std::string FastScheduler::Schedule(const int64_t* traffic, int num_servers,
                                    int gpus_per_server, bool with_transfers,
                                    FastSchedule* out, int64_t gpu) {
  if (num_servers < 1) return "num_servers must be >= 1";
  if (gpus_per_server < 1) return "gpus_per_server must be >= 1";
  const int n = n_ = num_servers;
  const int m = m_ = gpus_per_server;
  const int64_t g = static_cast<int64_t>(n) * m;
  if (gpu < -1 || gpu >= g) return "gpu must be -1 (all) or in [0, G)";
  gpu_ = gpu;
  out->num_servers = n;
  out->gpus_per_server = m;

  // Server matrix.
  // Add the M rows of server a elementwise (vectorises), then sum tiles;
  // OR-ing all entries is negative iff one of them is.
  out->server.assign(static_cast<size_t>(n) * n, 0);
  rowacc_.resize(g);
  int64_t any_sign = 0;
  for (int a = 0; a < n; ++a) {
    int64_t* acc = rowacc_.data();
    const int64_t* row = traffic + static_cast<int64_t>(a) * m * g;
    for (int64_t h = 0; h < g; ++h) acc[h] = row[h];
    for (int i = 1; i < m; ++i) {
      row += g;
      for (int64_t h = 0; h < g; ++h) acc[h] += row[h];
    }
    row = traffic + static_cast<int64_t>(a) * m * g;
    for (int64_t h = 0; h < static_cast<int64_t>(m) * g; ++h) {
      any_sign |= row[h];
    }
    int64_t* drow = out->server.data() + static_cast<int64_t>(a) * n;
    for (int b = 0; b < n; ++b) {
      int64_t sum = 0;
      for (int h = 0; h < m; ++h) sum += acc[static_cast<int64_t>(b) * m + h];
      drow[b] = sum;
    }
  }
  const int64_t lowest = any_sign;
  if (lowest < 0) return "traffic must be non-negative";
  for (int a = 0; a < n; ++a) out->server[static_cast<int64_t>(a) * n + a] = 0;

  // Padding (greedy, rows then columns in order).
  remaining_.assign(2 * static_cast<size_t>(n), 0);  // row, col deficits
  int64_t* dr = remaining_.data();
  int64_t* dc = dr + n;
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      const int64_t x = out->server[static_cast<int64_t>(a) * n + b];
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

  if (!Decompose(out)) return "internal error: no perfect matching";

  // Real units per stage (real data first, padding never moves).
  const int S = out->num_stages;
  out->real.assign(static_cast<size_t>(S) * n, 0);
  remaining_.assign(out->server.begin(), out->server.end());
  for (int k = 0; k < S; ++k) {
    const int64_t w = out->weights[k];
    for (int a = 0; a < n; ++a) {
      const int b = static_cast<int>(out->matchings[static_cast<int64_t>(k) * n + a]);
      if (a == b) continue;
      int64_t& rem = remaining_[static_cast<int64_t>(a) * n + b];
      const int64_t x = std::min(w, rem);
      out->real[static_cast<int64_t>(k) * n + a] = x;
      rem -= x;
    }
  }
  out->transfers.clear();
  out->redistribution.clear();
  if (with_transfers) BuildTransfers(traffic, out);
  return {};
}

void FastScheduler::BuildTransfers(const int64_t* traffic, FastSchedule* out) {
  const int n = n_, m = m_;
  const int64_t g = static_cast<int64_t>(n) * m;
  RowBuffer& tr = out->transfers;
  // With gpu_ >= 0 only rows that gpu_ sends or receives are kept, and only
  // the tiles of its server (as source or destination) are expanded.
  const int64_t only = gpu_;
  const int gs = gpu_ >= 0 ? static_cast<int>(gpu_ / m) : -1;
  const int gl = gpu_ >= 0 ? static_cast<int>(gpu_ % m) : -1;
  auto emit = [&tr, only](int64_t stage, int64_t src, int64_t dst,
                          int64_t amount, int64_t fs, int64_t fd) {
    if (only >= 0 && src != only && dst != only) return;
    int64_t* w = tr.Append(kTransferCols);
    w[kStage] = stage;
    w[kSrc] = src;
    w[kDst] = dst;
    w[kAmount] = amount;
    w[kFlowSrc] = fs;
    w[kFlowDst] = fd;
  };

  // 1. Balancing: build every lane queue into pool_.
  const size_t lanes = static_cast<size_t>(n) * n * m;
  qbeg_.assign(lanes, 0);
  qend_.assign(lanes, 0);
  pool_.clear();
  held_.resize(m);
  have_.resize(m);
  want_.resize(m);
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      if (a == b || (gs >= 0 && a != gs && b != gs)) continue;
      const int64_t big = out->server[static_cast<int64_t>(a) * n + b];
      const int off = (a + b) % m;
      for (int i = 0; i < m; ++i) {
        const int64_t s = static_cast<int64_t>(a) * m + i;
        const int64_t* tile = traffic + s * g + static_cast<int64_t>(b) * m;
        std::vector<Piece>& q = held_[i];
        q.clear();
        int64_t sum = 0;
        for (int h = 0; h < m; ++h) {
          if (tile[h] > 0) {
            q.push_back({static_cast<int32_t>(s),
                         static_cast<int32_t>(static_cast<int64_t>(b) * m + h),
                         tile[h]});
            sum += tile[h];
          }
        }
        have_[i] = sum;
      }
      {  // want_[l] = units u < big with (u + off) % m == l.
        const int64_t q = big / m;
        const int rem = static_cast<int>(big % m);
        for (int l = 0; l < m; ++l) {
          int d = l - off;
          if (d < 0) d += m;
          want_[l] = q + (d < rem ? 1 : 0);
        }
      }
      int j = 0;
      for (int i = 0; i < m; ++i) {
        while (have_[i] > want_[i]) {
          while (have_[j] >= want_[j]) ++j;
          int64_t x = std::min(have_[i] - want_[i], want_[j] - have_[j]);
          have_[i] -= x;
          have_[j] += x;
          std::vector<Piece>& src = held_[i];
          std::vector<Piece>& dst = held_[j];
          while (x > 0) {
            Piece& p = src.back();
            const int64_t y = std::min(x, p.amount);
            p.amount -= y;
            x -= y;
            const Piece moved{p.flow_src, p.flow_dst, y};
            if (p.amount == 0) src.pop_back();
            emit(0, static_cast<int64_t>(a) * m + i,
                 static_cast<int64_t>(a) * m + j, y, moved.flow_src,
                 moved.flow_dst);
            dst.push_back(moved);
          }
        }
      }
      for (int l = 0; l < m; ++l) {
        const size_t lane = (static_cast<size_t>(a) * n + b) * m + l;
        qbeg_[lane] = static_cast<int64_t>(pool_.size());
        pool_.insert(pool_.end(), held_[l].begin(), held_[l].end());
        qend_[lane] = static_cast<int64_t>(pool_.size());
      }
    }
  }

  // 4. Intra-server part.
  for (int64_t s = gs >= 0 ? int64_t{gs} * m : 0;
       s < (gs >= 0 ? int64_t{gs + 1} * m : g); ++s) {
    const int64_t base = (s / m) * m;
    for (int64_t h = base; h < base + m; ++h) {
      const int64_t x = traffic[s * g + h];
      if (h != s && x > 0) emit(1, s, h, x, s, h);
    }
  }

  // 2./3. Scale-out and redistribution per BvN stage.  Redistribution rows
  // go to out->redistribution so each stage is written in one pass.
  const int S = out->num_stages;
  sent_.assign(static_cast<size_t>(n) * n, 0);
  RowBuffer& red = out->redistribution;
  for (int k = 0; k < S; ++k) {
    const int64_t out_stage = 2 + 2 * static_cast<int64_t>(k);
    const int64_t* match = out->matchings.data() + static_cast<int64_t>(k) * n;
    for (int a = 0; a < n; ++a) {
      // The pairs of a stage are scattered over the queues: fetch the queue
      // bounds two servers ahead and the head pieces one server ahead.
      if (a + 2 < n) {
        __builtin_prefetch(qbeg_.data() + (static_cast<size_t>(a + 2) * n +
                                           match[a + 2]) * m);
      }
      if (a + 1 < n) {
        const int64_t* nb =
            qbeg_.data() + (static_cast<size_t>(a + 1) * n + match[a + 1]) * m;
        for (int l = 0; l < m; ++l) __builtin_prefetch(pool_.data() + nb[l]);
      }
      const int64_t x = out->real[static_cast<int64_t>(k) * n + a];
      if (x == 0) continue;
      const int b = static_cast<int>(match[a]);
      if (gs >= 0 && a != gs && b != gs) continue;
      // Sending server only: just gpu_'s lane.  Receiving server: every
      // lane (any of them may forward to gpu_).
      const int l_begin = (gs >= 0 && b != gs) ? gl : 0;
      const int l_end = (gs >= 0 && b != gs) ? gl + 1 : m;
      int64_t& sent = sent_[static_cast<int64_t>(a) * n + b];
      // Units sent..sent+x-1; unit u goes to lane (u + a + b) % m: every
      // lane gets x / m, the x % m lanes from first_lane on get one more.
      const int64_t q = x / m;
      const int rem = static_cast<int>(x % m);
      const int first_lane = static_cast<int>((sent + a + b) % m);
      const size_t lane0 = (static_cast<size_t>(a) * n + b) * m;
      for (int l = l_begin; l < l_end; ++l) {
        int d = l - first_lane;
        if (d < 0) d += m;
        int64_t c = q + (d < rem ? 1 : 0);
        const size_t lane = lane0 + l;
        int64_t h = qbeg_[lane];
        const int64_t src = static_cast<int64_t>(a) * m + l;
        const int64_t dst = static_cast<int64_t>(b) * m + l;
        while (c > 0) {
          Piece& p = pool_[h];
          const int64_t y = std::min(c, p.amount);
          emit(out_stage, src, dst, y, p.flow_src, p.flow_dst);
          if (p.flow_dst != dst &&
              (only < 0 || dst == only || p.flow_dst == only)) {
            int64_t* w = red.Append(kTransferCols);
            w[kStage] = out_stage + 1;
            w[kSrc] = dst;
            w[kDst] = p.flow_dst;
            w[kAmount] = y;
            w[kFlowSrc] = p.flow_src;
            w[kFlowDst] = p.flow_dst;
          }
          c -= y;
          if (y == p.amount) {
            ++h;
          } else {
            p.amount -= y;
          }
        }
        qbeg_[lane] = h;
      }
      sent += x;
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

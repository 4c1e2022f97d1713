"""Pure-Python reference of the FAST all-to-all(v) scheduler.

FAST (Lei et al., NSDI '26) schedules a skewed all-to-all(v) on a two-tier
fabric (fast intra-server links, slow inter-server NICs) in four parts:

1. **Balancing** (intra-server): for every ordered server pair (a, b), a != b,
   the GPUs of server ``a`` exchange data so that each of them holds (nearly)
   the same volume for server ``b``.
2. **Birkhoff-von Neumann stages** (inter-server): the server-level matrix
   ``D[a, b]`` (sum of the ``a -> b`` tile, zero diagonal) is padded to equal
   row and column sums ``L`` and decomposed into integer-weighted perfect
   matchings.  In a stage with matching ``pi`` and weight ``w``, server ``a``
   sends ``w`` units (real data first, padding never moves) to ``pi[a]``;
   GPU ``l`` of ``a`` sends its share to GPU ``l`` of ``pi[a]`` (peer rule).
3. **Redistribution** (intra-server, per stage): the receiving peer forwards
   each piece to its true destination GPU.
4. **Intra-server part**: ``T[g, h]`` for g != h on the same server goes
   directly.  ``T[g, g]`` is a local copy and never appears as a transfer.

Rounding rule (balancing and per-stage GPU shares): the ``R = D[a, b]`` units
of the pair are numbered ``u = 0 .. R-1`` in the order they cross the
network; unit ``u`` is carried by local GPU ``(u + a + b) % M``.  So each GPU
carries ``R // M`` or ``R // M + 1`` units in total, and ``w // M`` or
``w // M + 1`` in every stage; the rotation by ``a + b`` spreads the extra
units over different GPUs for different server pairs (on both the sending
and the receiving side).

Everything here is deterministic; ``moe_jax._fast`` (C++) implements the same
algorithm with the same tie-breaking and returns the same schedule.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

Flow = tuple[int, int]  # (original source GPU, final destination GPU)


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One point-to-point copy: ``amount`` units of ``flow`` from src to dst."""
  src_gpu: int
  dst_gpu: int
  amount: int
  flow: Flow


@dataclasses.dataclass
class Stage:
  """Concurrent transfers; ``kind`` in balance|intra|scale_out|redistribute.

  For ``scale_out`` and ``redistribute`` stages, ``bvn_index`` is the index
  of the server-level stage they belong to (else -1).
  """
  kind: str
  transfers: list[Transfer]
  bvn_index: int = -1


@dataclasses.dataclass
class Schedule:
  """A FAST schedule.

  Attributes:
    num_servers, gpus_per_server: topology (GPU ``g`` is local GPU
      ``g % M`` of server ``g // M``).
    traffic: int64[G, G] input matrix.
    server_matrix: int64[n, n], ``D`` (zero diagonal).
    padded_matrix: int64[n, n], ``D + P`` with all row/col sums ``bound``.
    bound: ``L``, max row/col sum of ``D`` (= of the padded matrix).
    matchings: int64[S, n]; ``matchings[k, a]`` is the server ``a`` sends
      to in BvN stage ``k`` (a perfect matching of the padded matrix).
    weights: int64[S]; BvN weight of stage ``k`` (sum == ``bound``).
    real: int64[S, n]; real (non-padding) units server ``a`` sends in stage k.
    stages: GPU-level stages in execution order: balance, intra, then
      (scale_out, redistribute) per BvN stage.
  """
  num_servers: int
  gpus_per_server: int
  traffic: np.ndarray
  server_matrix: np.ndarray
  padded_matrix: np.ndarray
  bound: int
  matchings: np.ndarray
  weights: np.ndarray
  real: np.ndarray
  stages: list[Stage]

  @property
  def num_bvn_stages(self) -> int:
    return int(self.weights.shape[0])

  def server_stage_times(self) -> np.ndarray:
    """int64[S]: the largest real server-to-server transfer of each stage."""
    if self.real.size == 0:
      return np.zeros((0,), np.int64)
    return self.real.max(axis=1)


def _check_traffic(traffic, num_servers: int, gpus_per_server: int) -> np.ndarray:
  if not isinstance(num_servers, (int, np.integer)) or num_servers < 1:
    raise ValueError(f"num_servers must be a positive int, got {num_servers!r}")
  if not isinstance(gpus_per_server, (int, np.integer)) or gpus_per_server < 1:
    raise ValueError(
        f"gpus_per_server must be a positive int, got {gpus_per_server!r}")
  t = np.asarray(traffic)
  g = num_servers * gpus_per_server
  if t.shape != (g, g):
    raise ValueError(
        f"traffic must have shape ({g}, {g}) for {num_servers} servers x "
        f"{gpus_per_server} GPUs, got {t.shape}")
  if t.size and not np.issubdtype(t.dtype, np.integer):
    if not np.all(np.equal(np.mod(t, 1), 0)):
      raise ValueError("traffic must hold integers (bytes or rows)")
  t = t.astype(np.int64)
  if t.size and t.min() < 0:
    raise ValueError("traffic must be non-negative")
  return t


def server_matrix(traffic, num_servers: int, gpus_per_server: int) -> np.ndarray:
  """int64[n, n]: tile sums of the ``G x G`` traffic, zero diagonal."""
  t = _check_traffic(traffic, num_servers, gpus_per_server)
  n, m = num_servers, gpus_per_server
  d = t.reshape(n, m, n, m).sum(axis=(1, 3))
  np.fill_diagonal(d, 0)
  return d


def lower_bounds(traffic, num_servers: int, gpus_per_server: int) -> dict:
  """Lower bounds: max row/col sum of the server and of the GPU matrix.

  Returns dict with ``server`` (max row/col sum of the inter-server matrix
  ``D``; FAST's scale-out time in units, optimal for ``M`` NICs per server
  is ``server / M``), ``gpu_inter`` (max per-GPU inter-server send or
  receive volume: what a per-GPU direct schedule needs on one NIC) and
  ``gpu`` (max row/col sum of the whole GPU matrix without the diagonal).
  """
  t = _check_traffic(traffic, num_servers, gpus_per_server)
  n, m = num_servers, gpus_per_server
  d = server_matrix(t, n, m)
  srv = np.arange(n * m) // m
  inter = np.where(srv[:, None] != srv[None, :], t, 0)
  off = t.copy()
  np.fill_diagonal(off, 0)

  def mx(x):
    return int(max(x.sum(0).max(initial=0), x.sum(1).max(initial=0)))

  return {"server": mx(d), "gpu_inter": mx(inter), "gpu": mx(off)}


def pad_matrix(d: np.ndarray) -> np.ndarray:
  """int64[n, n]: ``d`` plus non-negative padding, all row/col sums equal.

  Greedy: rows in order, columns in order, add ``min(row deficit, column
  deficit)``.  Full rows/columns (the bottleneck) get no padding.
  """
  d = np.asarray(d, np.int64)
  n = d.shape[0]
  p = d.copy()
  if n == 0:
    return p
  rs, cs = d.sum(1), d.sum(0)
  big = max(rs.max(), cs.max())
  dr, dc = big - rs, big - cs
  j = 0
  for i in range(n):
    while dr[i] > 0:
      while dc[j] == 0:
        j += 1
      x = min(dr[i], dc[j])
      p[i, j] += x
      dr[i] -= x
      dc[j] -= x
  return p


def _augment(u, res, match_col, match_row):
  """Shortest augmenting path from free row ``u`` by breadth-first search
  over columns with positive residual (rows dequeued in order, columns
  scanned in order); flips it.  Returns whether one was found."""
  n = len(match_col)
  visited = [False] * n
  prev = [-1] * n
  queue = [u]
  head = 0
  while head < len(queue):
    r = queue[head]
    head += 1
    row = res[r]
    for v in range(n):
      if row[v] <= 0 or visited[v]:
        continue
      visited[v] = True
      prev[v] = r
      if match_col[v] < 0:
        c = v
        while True:
          pr = prev[c]
          old = match_row[pr]
          match_row[pr] = c
          match_col[c] = pr
          if pr == u:
            return True
          c = old
      queue.append(match_col[v])
  return False


def bvn_decompose(padded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Integer Birkhoff-von Neumann decomposition of an equal-sum matrix.

  Repeats: perfect matching on the support (augmenting paths found by
  breadth-first search, free rows in order; the previous matching is kept
  and only the rows whose matched entry became zero are re-augmented), weight = smallest
  matched entry, subtract.  Each step zeroes an entry and lowers
  ``edges - 2n + components`` by at least one, so there are at most
  ``n^2 - 2n + 2`` stages.

  Returns (matchings int64[S, n], weights int64[S]).
  """
  r = [list(map(int, row)) for row in np.asarray(padded, np.int64)]
  n = len(r)
  match_row = [-1] * n
  match_col = [-1] * n
  mats, ws = [], []
  total = sum(r[0]) if n else 0
  while total > 0:
    for u in range(n):
      if match_row[u] < 0:
        if not _augment(u, r, match_col, match_row):
          raise AssertionError("no perfect matching: matrix not equal-sum")
    w = min(r[u][match_row[u]] for u in range(n))
    mats.append(list(match_row))
    ws.append(w)
    total -= w
    for u in range(n):
      v = match_row[u]
      r[u][v] -= w
      if r[u][v] == 0:
        match_row[u] = -1
        match_col[v] = -1
  return (np.asarray(mats, np.int64).reshape(len(ws), n),
          np.asarray(ws, np.int64))


def _unit_count(start: int, count: int, lane: int, off: int, m: int) -> int:
  """How many units u in [start, start+count) satisfy (u + off) % m == lane."""
  r = (lane - off) % m

  def f(x):
    return (x + m - 1 - r) // m

  return f(start + count) - f(start)


def stage_order(d: np.ndarray, matchings: np.ndarray, weights: np.ndarray
                ) -> np.ndarray:
  """int64[S]: the order the BvN stages run in (any order is valid).

  A stage's size is its largest real unit count over servers,
  ``min(weight, remaining D[a, pi(a)])`` computed in decomposition order
  (the schedule then recomputes the real units in the new order).  The lightest
  stage runs first (its balancing precedes every scale-out), the others
  by descending size, so each stage's redistribution and the next stage's
  balancing overlap a scale-out stage of about their own size and the
  last (exposed) redistribution is light.
  """
  s = int(weights.shape[0])
  if s <= 1:
    return np.arange(s, dtype=np.int64)
  n = d.shape[0]
  rem = np.asarray(d, np.int64).copy()
  size = np.zeros(s, np.int64)
  for k in range(s):
    b = matchings[k]
    x = np.minimum(weights[k], rem[np.arange(n), b])
    x[b == np.arange(n)] = 0
    rem[np.arange(n), b] -= x
    size[k] = x.max(initial=0)
  first = int(np.argmin(size))
  rest = [int(k) for k in np.argsort(-size, kind="stable") if k != first]
  return np.asarray([first] + rest, np.int64)


# Cumulative weights of the parts the second stage runs in (10 : 13 : 17).
SPLIT_CUM = (10, 23, 40)


def split_second_stage(matchings: np.ndarray, weights: np.ndarray,
                       gpus_per_server: int = 1
                       ) -> tuple[np.ndarray, np.ndarray]:
  """Splits the stage run second into three parts of growing weight.

  A stage's balancing by use runs during the previous stage's scale-out.
  After the light first stage the heaviest stage follows, whose balancing
  (up to about 0.8 of its own scale-out time at NIC:NVLink 1:9) a light
  stage cannot hide; in parts of weight 10 : 13 : 17 each part's balancing
  overlaps the previous part's scale-out and only the first, smaller part's
  remains exposed.  The cuts are rounded down to multiples of
  ``gpus_per_server`` (a part's lanes then carry equal shares whenever the
  stage's did); parts of weight 0 are dropped.
  """
  s = int(weights.shape[0])
  if s <= 1:
    return matchings, weights
  w = int(weights[1])
  parts, done = [], 0
  m = max(int(gpus_per_server), 1)
  for upto in SPLIT_CUM:
    to = w * upto // SPLIT_CUM[-1]
    if upto != SPLIT_CUM[-1]:
      to -= to % m
    if to > done:
      parts.append(to - done)
    done = to
  mats = np.concatenate([matchings[:1], np.repeat(matchings[1:2], len(parts), 0),
                         matchings[2:]])
  ws = np.concatenate([weights[:1], np.asarray(parts, weights.dtype),
                       weights[2:]])
  return mats, ws


def _lane_order(lane: int, m: int) -> list[int]:
  """Order in which lane ``lane`` queues its own flows into a server: by
  local destination from its own index on, ``lane, lane + 1, ..`` (mod M),
  so in every stage the lanes (whose shares advance alike) carry units
  for different destination GPUs and the redistribution spreads over the
  receiving server's GPUs."""
  return [(lane + i) % m for i in range(m)]


def fast_schedule(traffic, num_servers: int, gpus_per_server: int) -> Schedule:
  """Builds the FAST schedule of ``traffic`` (int[G, G], G = n * M)."""
  t = _check_traffic(traffic, num_servers, gpus_per_server)
  n, m = int(num_servers), int(gpus_per_server)
  d = server_matrix(t, n, m)
  padded = pad_matrix(d)
  bound = int(max(d.sum(0).max(initial=0), d.sum(1).max(initial=0)))
  mats, ws = bvn_decompose(padded)
  order = stage_order(d, mats, ws)
  mats, ws = split_second_stage(mats[order], ws[order], m)

  # 1. Balancing.  queues[a][b][l]: list of [flow, amount] GPU l of a carries
  # to server b, in sending order.
  balance: list[Transfer] = []
  queues = [[None] * n for _ in range(n)]
  for a in range(n):
    for b in range(n):
      if a == b:
        continue
      big = int(d[a, b])
      off = (a + b) % m
      held = []
      for i in range(m):
        g = a * m + i
        held.append([[(g, b * m + h), int(t[g, b * m + h])]
                     for h in _lane_order(i, m) if t[g, b * m + h] > 0])
      have = [sum(x[1] for x in q) for q in held]
      want = [_unit_count(0, big, l, off, m) for l in range(m)]
      j = 0
      for i in range(m):
        while have[i] > want[i]:
          while have[j] >= want[j]:
            j += 1
          x = min(have[i] - want[i], want[j] - have[j])
          have[i] -= x
          have[j] += x
          moved = []
          while x > 0:  # carve from the tail of GPU i's queue
            piece = held[i][-1]
            y = min(x, piece[1])
            piece[1] -= y
            x -= y
            if piece[1] == 0:
              held[i].pop()
            moved.append((piece[0], y))
          for flow, y in moved:
            balance.append(Transfer(a * m + i, a * m + j, y, flow))
            held[j].append([flow, y])
      queues[a][b] = held

  # 4. Intra-server part.
  intra = [Transfer(g, h, int(t[g, h]), (g, h))
           for g in range(n * m) for h in range(n * m)
           if g != h and g // m == h // m and t[g, h] > 0]

  stages = [Stage("balance", balance), Stage("intra", intra)]

  # 2./3. BvN stages with per-stage redistribution.
  remaining = d.copy()
  sent = np.zeros((n, n), np.int64)
  heads = {}  # (a, b, l) -> index of the queue's head piece
  real = np.zeros((len(ws), n), np.int64)
  for k in range(len(ws)):
    out, red = [], []
    for a in range(n):
      b = int(mats[k, a])
      if a == b:
        continue
      x = int(min(ws[k], remaining[a, b]))
      if x == 0:
        continue
      real[k, a] = x
      off = (a + b) % m
      for l in range(m):
        c = _unit_count(int(sent[a, b]), x, l, off, m)
        q = queues[a][b][l]
        h = heads.get((a, b, l), 0)
        while c > 0:
          flow, amt = q[h]
          y = min(c, amt)
          src, dst = a * m + l, b * m + l
          out.append(Transfer(src, dst, y, flow))
          if flow[1] != dst:
            red.append(Transfer(dst, flow[1], y, flow))
          c -= y
          if y == amt:
            h += 1
          else:
            q[h] = [flow, amt - y]
        heads[(a, b, l)] = h
      remaining[a, b] -= x
      sent[a, b] += x
    stages.append(Stage("scale_out", out, k))
    stages.append(Stage("redistribute", red, k))
  assert not remaining.any()
  return Schedule(n, m, t, d, padded, bound, mats, ws, real, stages)


def first_stages(matchings: np.ndarray, real: np.ndarray,
                 num_servers: int) -> np.ndarray:
  """int64[n, n]: ``[a, b]`` = first BvN stage in which server ``a`` sends
  real units to server ``b`` (-1 when it never does, e.g. ``a == b``).

  ``matchings`` and ``real``: int64[S, n] as in ``Schedule``.
  """
  n = int(num_servers)
  first = np.full((n, n), -1, np.int64)
  for k in range(real.shape[0] - 1, -1, -1):
    a = np.flatnonzero(real[k] > 0)
    first[a, matchings[k, a]] = k
  return first


def balance_stage(transfer: Transfer, first: np.ndarray, m: int) -> int:
  """BvN stage before which a balancing transfer must be done: the first
  stage of its server pair (source server, flow's destination server)."""
  return int(first[transfer.src_gpu // m, transfer.flow[1] // m])


def balance_by_stage(schedule: Schedule) -> list[list[Transfer]]:
  """The balancing phase split by the BvN stage it must precede.

  Balancing of pair (a, b) only moves data that crosses the network from
  ``a`` to ``b``, so it is due before the pair's first stage and may run
  during earlier stages.  Returns ``S`` lists (``S`` = BvN stages); list
  ``k`` holds, in their original order, the balancing transfers of the
  pairs first carried in stage ``k``.  Together they are exactly the
  transfers of the ``balance`` stage.
  """
  s, m = schedule.num_bvn_stages, schedule.gpus_per_server
  first = first_stages(schedule.matchings, schedule.real, schedule.num_servers)
  parts: list[list[Transfer]] = [[] for _ in range(s)]
  for tr in _stage_of_kind(schedule, "balance").transfers:
    parts[balance_stage(tr, first, m)].append(tr)
  return parts


def balance_by_use(schedule: Schedule) -> list[list[Transfer]]:
  """The balancing phase split by the BvN stage that sends the units.

  A GPU holds another GPU's units of a flow only through balancing, whose
  givers hand over their own pieces, so each scale-out transfer of stage k
  whose sender is not the flow's source needs that many units moved from
  the source to the sender before stage k.  Returns ``S`` lists; list ``k``
  holds one such transfer per scale-out transfer of stage ``k``.  Summed
  per (src, dst, flow) they are exactly the ``balance`` stage.
  """
  parts: list[list[Transfer]] = [[] for _ in range(schedule.num_bvn_stages)]
  for st in schedule.stages:
    if st.kind != "scale_out":
      continue
    for tr in st.transfers:
      if tr.src_gpu != tr.flow[0]:
        parts[st.bvn_index].append(
            Transfer(tr.flow[0], tr.src_gpu, tr.amount, tr.flow))
  return parts


def _stage_of_kind(schedule: Schedule, kind: str, bvn_index: int = -1
                   ) -> Stage:
  for st in schedule.stages:
    if st.kind == kind and st.bvn_index == bvn_index:
      return st
  raise KeyError((kind, bvn_index))


def pipelined_stages(schedule: Schedule, starts: Sequence[int] = (0,),
                     order: Sequence[int] | None = None,
                     timing: str = "pair") -> list[Stage]:
  """The schedule's transfers in a pipelined execution order.

  ``order[i]``: the BvN stage run i-th (default: as built; any order is
  valid, each stage moves what its GPUs hold after balancing).
  ``starts``: chunk starts 0 = s_0 < s_1 < ... (positions in ``order``);
  chunk j's balancing (pairs first carried at positions s_j .. s_{j+1} - 1)
  runs concurrently with the scale-out at position s_j - 1, chunk 0 before
  everything.  Returns ``balance`` (chunk 0), ``intra``, then per position
  ``scale_out`` (with the next chunk's balancing, if one starts there) and
  ``redistribute``.  Transfers of one stage run concurrently: a chunk's
  balancing moves pairs that no earlier stage carries.

  ``timing="use"``: the balancing is ``balance_by_use`` instead, chunk j
  holding the units first sent at positions s_j .. s_{j+1} - 1 (a giver
  hands over tail units its own scale-out never sends, so they may move
  while it sends its head units).
  """
  if timing not in ("pair", "use"):
    raise ValueError(f"timing must be 'pair' or 'use', got {timing!r}")
  s = schedule.num_bvn_stages
  order = list(range(s)) if order is None else [int(k) for k in order]
  if sorted(order) != list(range(s)):
    raise ValueError(f"order must be a permutation of range({s})")
  starts = [int(x) for x in starts]
  if s and (starts[0] != 0 or sorted(set(starts)) != starts or starts[-1] >= s):
    raise ValueError(f"starts must rise from 0 below {s}, got {starts}")
  pos = np.empty(s, np.int64)
  pos[order] = np.arange(s)
  real = schedule.real[order] if s else schedule.real
  first = first_stages(schedule.matchings[order] if s else schedule.matchings,
                       real, schedule.num_servers)
  m = schedule.gpus_per_server
  chunks: list[list[Transfer]] = [[] for _ in starts]
  if timing == "use":
    dated = [(int(pos[k]), tr)
             for k, part in enumerate(balance_by_use(schedule))
             for tr in part]
  else:
    dated = [(balance_stage(tr, first, m), tr)
             for tr in _stage_of_kind(schedule, "balance").transfers]
  for due, tr in dated:
    chunks[int(np.searchsorted(starts, due, side="right")) - 1].append(tr)
  with_chunk = {st - 1: c for st, c in zip(starts[1:], chunks[1:])}
  out = [Stage("balance", chunks[0]),
         Stage("intra", list(_stage_of_kind(schedule, "intra").transfers))]
  for i, k in enumerate(order):
    tr = list(_stage_of_kind(schedule, "scale_out", k).transfers)
    out.append(Stage("scale_out", tr + with_chunk.get(i, []), k))
    out.append(Stage("redistribute",
                     list(_stage_of_kind(schedule, "redistribute", k)
                          .transfers), k))
  return out


def spreadout_time(matrix) -> int:
  """Classic SpreadOut on a square matrix: sum over shifts i=1..N-1 of
  ``max_s matrix[s, (s+i) % N]`` (the diagonal is local, not counted)."""
  x = np.asarray(matrix, np.int64)
  n = x.shape[0]
  if x.ndim != 2 or x.shape[1] != n:
    raise ValueError(f"matrix must be square, got shape {x.shape}")
  s = np.arange(n)
  return int(sum(x[s, (s + i) % n].max(initial=0) for i in range(1, n)))


def spreadout_schedule(traffic) -> list[Stage]:
  """SpreadOut at GPU level: stage i (1..G-1), GPU g sends T[g, (g+i) % G]."""
  t = np.asarray(traffic, np.int64)
  g = t.shape[0]
  if t.ndim != 2 or t.shape[1] != g:
    raise ValueError(f"traffic must be square, got shape {t.shape}")
  return [Stage("spreadout", [Transfer(s, (s + i) % g, int(t[s, (s + i) % g]),
                                        (s, (s + i) % g))
                               for s in range(g) if t[s, (s + i) % g] > 0])
          for i in range(1, g)]


def simulate_delivery(traffic, stages: Sequence[Stage]) -> dict:
  """Runs ``stages`` on per-GPU holdings; raises ValueError on a bad move.

  Every transfer of a stage may only use data its source GPU held when the
  stage began (transfers of one stage are concurrent).  Returns the final
  holdings ``{(gpu, flow): amount}`` (zero entries dropped).  A correct
  schedule ends with exactly ``{(dst, (src, dst)): T[src, dst]}``.
  """
  t = np.asarray(traffic, np.int64)
  hold = {}
  for s in range(t.shape[0]):
    for d in range(t.shape[1]):
      if t[s, d] > 0:
        hold[(s, (s, d))] = int(t[s, d])
  for si, st in enumerate(stages):
    start = dict(hold)
    for tr in st.transfers:
      if tr.amount <= 0:
        raise ValueError(f"stage {si}: non-positive amount in {tr}")
      key = (tr.src_gpu, tr.flow)
      if start.get(key, 0) < tr.amount:
        raise ValueError(f"stage {si}: {tr} moves data GPU {tr.src_gpu} "
                         "did not hold at the stage start")
      start[key] -= tr.amount
      hold[key] -= tr.amount
      hold[(tr.dst_gpu, tr.flow)] = hold.get((tr.dst_gpu, tr.flow), 0) + tr.amount
  return {k: v for k, v in hold.items() if v}


def delivered_exactly(traffic, stages: Sequence[Stage]) -> bool:
  """True iff every unit of every flow ends at its destination GPU once."""
  t = np.asarray(traffic, np.int64)
  want = {(d, (s, d)): int(t[s, d]) for s in range(t.shape[0])
          for d in range(t.shape[1]) if t[s, d] > 0}
  return simulate_delivery(t, stages) == want

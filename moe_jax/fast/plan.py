"""Execution plan of a FAST schedule: which buffer rows every copy moves.

A FAST schedule (``reference.fast_schedule``) says how many units of each
flow ``(s, d)`` go from GPU to GPU in each stage.  To execute it on real
buffers we also need *which* rows: this module replays the schedule on
per-GPU holdings and turns every transfer into ops that move one contiguous
row range of one flow from one buffer to another.

Buffers of GPU ``g`` (rows of ``H`` elements each):

* ``x`` [R]: its send rows, grouped by destination; flow ``(g, d)`` is
  ``x[send_off[g, d] : send_off[g, d] + T[g, d]]``.
* ``out`` [R_out]: its received rows, grouped by source; flow ``(s, g)``
  lands at ``out[recv_off[s, g] : recv_off[s, g] + T[s, g]]``.
* ``ws`` [W]: workspace for rows relayed through ``g`` (balancing and
  scale-out hops whose final destination is another GPU).  Rows are
  bump-allocated in op order and never reused, so no slot is written twice.

Which rows a transfer moves (any choice is exact as long as each row moves
once): balancing reserves the *last* rows of the source's flow (receivers
in stream order from the last row down) and moves them *by use*, front
first; scale-out, redistribution and the intra-server part take the
*first* rows held.

Phases (what may run concurrently; the FAST pipeline, NSDI '26 section 4.3),
one NCCL group each: phase 0 holds the local copies ``T[g, g]`` and the
balancing of BvN stage 0's units; phase ``k + 1`` the scale-out of stage
``k``, stage ``k``'s share of the intra-server part (``intra_cuts``), the
redistribution of stage ``k - 1`` (k > 0), the balancing of the units
stage ``k + 1`` sends (for k + 1 > 1 what ``balancing_early`` did not
move a phase before) and the early part of stage ``k + 2``'s; phase
``S + 1`` the last redistribution.  Without scale-out the intra-server part
runs in phase 0.  Every op of a phase reads only rows that
were in place when the phase began, and no two ops write the same row.

``moe_jax._fast.plan`` (xla_ffi/fast/plan.cc) builds the same ops in C++;
the CUDA custom call executes them through NCCL.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from moe_jax.fast import reference as ref

# Columns of an op row (int64).
(PHASE, SRC, DST, ROWS, SRC_BUF, SRC_ROW, DST_BUF, DST_ROW, FLOW_SRC,
 FLOW_DST, FLOW_ROW) = range(11)
OP_COLS = 11
# Buffer codes: a source is x or ws, a destination out or ws.
X, OUT, WS = 0, 0, 1


@dataclasses.dataclass
class ExecutionPlan:
  """Ops of a FAST schedule on concrete buffers.

  Attributes:
    ops: int64[K, OP_COLS], in execution order (phases non-decreasing).
      Row: phase, src GPU, dst GPU, rows, src buffer (X/WS), first src row,
      dst buffer (OUT/WS), first dst row, flow source, flow destination,
      first row within the flow.  ``src == dst`` only for local copies.
    num_phases: 1 + the largest phase of an op (0 without ops).
    workspace_used: int64[G], workspace rows each GPU needs.
    num_servers, gpus_per_server: the topology the schedule was built for.
  """
  ops: np.ndarray
  num_phases: int
  workspace_used: np.ndarray
  num_servers: int
  gpus_per_server: int


def send_offsets(traffic) -> np.ndarray:
  """int64[G, G]: ``[s, d]`` = first row of flow (s, d) in ``x`` of s."""
  t = np.asarray(traffic, np.int64)
  return np.cumsum(t, axis=1) - t


def recv_offsets(traffic) -> np.ndarray:
  """int64[G, G]: ``[s, d]`` = first row of flow (s, d) in ``out`` of d."""
  t = np.asarray(traffic, np.int64)
  return np.cumsum(t, axis=0) - t


def effective_traffic(counts, rows_in: int, rows_out: int) -> np.ndarray:
  """int64[G, G]: what a ragged all-to-all with these buffers can move.

  ``counts[s, d]`` is what rank s asks to send to d.  Negative counts are
  0; a sender's rows past ``rows_in`` (destinations in order) and a
  receiver's rows past ``rows_out`` (sources in order) are dropped.  Every
  execution path (and the reference) moves exactly this matrix.
  """
  c = np.clip(np.asarray(counts, np.int64), 0, rows_in)
  cum = np.cumsum(c, axis=1)
  c = np.minimum(cum, rows_in) - np.minimum(cum - c, rows_in)
  cum = np.cumsum(c, axis=0)
  return np.minimum(cum, rows_out) - np.minimum(cum - c, rows_out)


def workspace_rows(rows_in: int, rows_out: int, num_servers: int,
                   gpus_per_server: int) -> int:
  """Workspace rows that suffice on every GPU for any traffic that fits.

  With every row sum <= rows_in and every column sum <= rows_out, GPU l of
  server a receives at most ceil(D[a, b] / M) balancing units per server b
  (sum over b <= rows_in + n - 1), and as the scale-out peer of server b at
  most ceil(D[a, b] / M) units from each source server a (sum over a <=
  rows_out + n - 1).  One server (no scale-out) or one GPU per server (no
  balancing; the peer is the destination) needs none.
  """
  if num_servers <= 1 or gpus_per_server <= 1:
    return 0
  return int(rows_in) + int(rows_out) + 2 * (int(num_servers) - 1)


def max_phases(num_servers: int) -> int:
  """Upper bound of ``num_phases`` for any traffic on ``num_servers``."""
  if num_servers <= 1:
    return 1
  # BvN stages (n^2 - 2n + 2, the second in three parts), phase 0 and the
  # last redistribution.
  return num_servers * num_servers - 2 * num_servers + 2 + 2 + 2


def intra_cuts(real, num_servers: int):
  """Where the intra-server part splits over the BvN stages.

  Returns ``cut(amount, k)``: the rows of an intra-server flow of
  ``amount`` rows sent before BvN stage k (``cut(amount, 0) == 0``,
  ``cut(amount, S) == amount``).  The first ``min(S, 2n)`` stages (in the
  order they run) carry the flow in proportion to their size, the largest
  real unit count over servers (``real`` int[S, n]), which is what their
  scale-out lasts; the rest carry none.  Every GPU derives the same cuts
  from the server-level schedule.
  """
  real = np.asarray(real, np.int64).reshape(-1, max(int(num_servers), 1))
  s = real.shape[0]
  size = real.max(axis=1) if s else np.zeros(0, np.int64)
  size[2 * int(num_servers):] = 0
  cum = [0]
  for x in size:
    cum.append(cum[-1] + int(x))
  total = cum[-1]

  def cut(amount: int, k: int) -> int:
    if total == 0:
      return 0 if k == 0 else int(amount)
    return int(amount) * cum[k] // total

  return cut


# Of a redistribution transfer of ``amount`` rows (BvN stage k < S - 1),
# the last ``amount * num // den`` run a phase later, beside the next
# stage's redistribution (``redistribution_split``).
REDISTRIBUTION_DEFER = (1, 4)


def redistribution_split(amount: int) -> int:
  """Rows of a redistribution transfer (not the last stage's) that run in
  phase ``k + 3`` instead of ``k + 2``: its last quarter (rounded down).
  A hot GPU's redistribution of one stage then spreads over two scale-out
  stages; the relay sends the piece's head, then its tail, so the
  destination still receives each lane's rows of a flow in order."""
  num, den = REDISTRIBUTION_DEFER
  return int(amount) * num // den


# NIC : NVLink bandwidth per GPU the balancing split is sized for (the
# paper's H200 testbed, 50 vs 450 GB/s).
NIC_NVLINK = (1, 9)


def balancing_early(real, num_servers: int, gpus_per_server: int):
  """How much of each stage's balancing by use runs a phase early.

  Returns ``early(amount, k)``: of a balancing use of ``amount`` rows for
  BvN stage k, the first rows, which move in phase ``k - 1`` instead of
  ``k`` (0 for k < 2).  A hot sender hands ``(M - 1) / M`` of its stage
  share over NVLink while the stage's scale-out sends ``1 / M`` of it over
  its NIC, so stage k's balancing needs up to ``(M - 1) x NIC / NVLink`` of
  its size (largest real unit count over servers) on NVLink.  From the last
  stage down, each stage's balancing fills what is left of its phase's
  scale-out (the previous stage's size), then of the phase before; the
  rest stays in its own phase.  Every GPU derives the same split from the
  server-level schedule.
  """
  n, m = max(int(num_servers), 1), int(gpus_per_server)
  real = np.asarray(real, np.int64).reshape(-1, n)
  s = real.shape[0]
  size = [int(x) for x in real.max(axis=1)] if s else []
  nic, nvlink = NIC_NVLINK
  # Phase p (1 <= p <= S) hides NVLink work of nvlink * size[p - 1] (in
  # units of rows / nvlink).
  room = [0] + [nvlink * x for x in size]
  need = [nic * (m - 1) * x for x in size]
  early = [0] * s
  for k in range(s - 1, 0, -1):
    own = min(room[k], need[k])
    room[k] -= own
    if k >= 2:
      early[k] = min(room[k - 1], need[k] - own)
      room[k - 1] -= early[k]

  def cut(amount: int, k: int) -> int:
    if k < 2 or early[k] == 0:
      return 0
    return int(amount) * early[k] // need[k]

  return cut


def stage_phase(kind: str, bvn_index: int, num_bvn_stages: int) -> int:
  """Phase of a schedule stage (see the module docstring); for the
  intra-server part, split over the stages (``intra_cuts``), the phase of
  BvN stage ``bvn_index``'s share."""
  if kind == "balance":
    return 0
  if kind == "intra":
    return bvn_index + 1 if num_bvn_stages > 0 else 0
  if kind == "scale_out":
    return bvn_index + 1
  if kind == "redistribute":
    return bvn_index + 2
  raise ValueError(f"unknown stage kind {kind!r}")


class _Holdings:
  """Rows of each flow a GPU holds (not yet at their destination).

  Key (gpu, flow_src, flow_dst) -> segments [flow_row, rows, buf, row,
  ready_phase] sorted by flow_row; a segment may be read from phase
  ``ready_phase`` on.
  """

  def __init__(self):
    self.segs: dict[tuple[int, int, int], list[list[int]]] = {}

  def add(self, key, flow_row, rows, buf, row, ready):
    segs = self.segs.setdefault(key, [])
    i = bisect.bisect_left([s[0] for s in segs], flow_row)
    segs.insert(i, [flow_row, rows, buf, row, ready])

  def take(self, key, amount, from_tail, phase):
    """Removes ``amount`` rows; returns pieces (flow_row, rows, buf, row)
    in increasing flow_row order."""
    segs = self.segs.get(key, [])
    pieces = []
    while amount > 0:
      if not segs:
        raise ValueError(f"GPU {key[0]} does not hold {amount} more rows of "
                         f"flow {key[1:]}")
      seg = segs[-1] if from_tail else segs[0]
      if seg[4] > phase:
        raise ValueError(f"phase {phase}: GPU {key[0]} would forward rows of "
                         f"flow {key[1:]} that arrive in phase {seg[4] - 1}")
      y = min(amount, seg[1])
      if from_tail:
        pieces.append((seg[0] + seg[1] - y, y, seg[2], seg[3] + seg[1] - y))
      else:
        pieces.append((seg[0], y, seg[2], seg[3]))
        seg[0] += y
        seg[3] += y
      seg[1] -= y
      amount -= y
      if seg[1] == 0:
        segs.pop(-1 if from_tail else 0)
    if not segs:
      self.segs.pop(key, None)
    if from_tail:
      pieces.reverse()
    return pieces


def execution_plan(traffic, num_servers: int, gpus_per_server: int,
                   schedule: ref.Schedule | None = None) -> ExecutionPlan:
  """Builds the ops that execute the FAST schedule of ``traffic``.

  Args:
    traffic: int[G, G] rows per flow (``T[s, d]``, diagonal = local rows).
    num_servers, gpus_per_server: topology (G = n * M).
    schedule: the schedule of ``traffic`` (default: computed here).
  Raises:
    ValueError: the schedule moves rows a GPU does not hold, or leaves rows
      undelivered.
  """
  t = ref._check_traffic(traffic, num_servers, gpus_per_server)
  n, m = int(num_servers), int(gpus_per_server)
  g = n * m
  if schedule is None:
    schedule = ref.fast_schedule(t, n, m)
  so, ro = send_offsets(t), recv_offsets(t)
  s_bvn = schedule.num_bvn_stages
  # Rows each balancing transfer of the schedule gives: the giver's tail,
  # receivers in stream order from the last row down (as if all balancing
  # ran at once).  They move by use, front first (``balance_phase``).
  given = np.zeros((g, g), np.int64)
  reserved: dict[tuple[int, int, int, int], list[list[int]]] = {}
  for tr in ref._stage_of_kind(schedule, "balance").transfers:
    fs, fd = tr.flow
    given[fs, fd] += tr.amount
    reserved.setdefault((fs, tr.dst_gpu, fs, fd), []).append(
        [int(t[fs, fd] - given[fs, fd]), tr.amount])
  for segs in reserved.values():
    segs.reverse()  # front (lowest rows) first
  hold = _Holdings()
  for s in range(g):
    for d in range(g):
      kept = int(t[s, d] - given[s, d])
      if s != d and kept > 0:
        hold.add((s, s, d), 0, kept, X, int(so[s, d]), 0)
  bump = np.zeros(g, np.int64)
  ops = []
  for s in range(g):
    if t[s, s] > 0:
      ops.append((0, s, s, int(t[s, s]), X, int(so[s, s]), OUT, int(ro[s, s]),
                  s, s, 0))

  def move(phase, src, dst, pieces, fs, fd):
    for flow_row, rows, buf, row in pieces:
      if dst == fd:
        dst_buf, dst_row = OUT, int(ro[fs, fd]) + flow_row
      else:
        dst_buf, dst_row = WS, int(bump[dst])
        bump[dst] += rows
        hold.add((dst, fs, fd), flow_row, rows, WS, dst_row, phase + 1)
      ops.append((phase, src, dst, rows, buf, row, dst_buf, dst_row, fs, fd,
                  flow_row))

  def run(stage, phase, part=None):
    """Every transfer of ``stage``; ``part`` ("head" / "tail") only the
    rows ``redistribution_split`` gives it (the tail: the head's rest)."""
    for tr in stage.transfers:
      fs, fd = tr.flow
      tail = redistribution_split(tr.amount)
      y = {None: tr.amount, "head": tr.amount - tail, "tail": tail}[part]
      if y > 0:
        move(phase, tr.src_gpu, tr.dst_gpu,
             hold.take((tr.src_gpu, fs, fd), y, False, phase), fs, fd)

  early = balancing_early(schedule.real, n, m)
  late_ops = []

  def balance(k, phase):
    """Balancing by use: the units stage k's scale-out sends from a lane
    that is not the flow's source, from the front of their reserved
    rows, into workspace the lane reserves for the whole use; the first
    ``early(amount, k)`` rows move in ``phase``, the rest (``late_ops``)
    in ``k``."""
    for tr in ref._stage_of_kind(schedule, "scale_out", k).transfers:
      fs, fd = tr.flow
      j = tr.src_gpu
      if j == fs:
        continue
      segs = reserved[(fs, j, fs, fd)]
      head = early(tr.amount, k) if phase < k else tr.amount
      left = tr.amount
      while left > 0:
        seg = segs[0]
        y = min(left, seg[1])
        row = int(bump[j])
        bump[j] += y
        hold.add((j, fs, fd), seg[0], y, WS, row, k + 1)
        now = min(max(head - (tr.amount - left), 0), y)
        for at, rows, into in ((0, now, ops), (now, y - now, late_ops)):
          if rows > 0:
            into.append((phase if into is ops else k, fs, j, rows, X,
                         int(so[fs, fd]) + seg[0] + at, WS, row + at, fs, fd,
                         seg[0] + at))
        seg[0] += y
        seg[1] -= y
        left -= y
        if seg[1] == 0:
          segs.pop(0)

  def balance_late():
    ops.extend(late_ops)
    late_ops.clear()

  intra = ref._stage_of_kind(schedule, "intra")
  cut = intra_cuts(schedule.real, n)

  def run_intra(k, phase):
    """Stage k's share of every intra-server flow, from its first rows
    not yet sent."""
    for tr in intra.transfers:
      y = cut(tr.amount, k + 1) - cut(tr.amount, k)
      if y > 0:
        fs, fd = tr.flow
        move(phase, fs, fd, hold.take((fs, fs, fd), y, False, phase), fs, fd)

  if s_bvn == 0:
    run(intra, 0)
  else:
    balance(0, 0)
    for k in range(s_bvn):
      run(ref._stage_of_kind(schedule, "scale_out", k), k + 1)
      run_intra(k, k + 1)
      if k > 1:
        run(ref._stage_of_kind(schedule, "redistribute", k - 2), k + 1, "tail")
      if k > 0:
        run(ref._stage_of_kind(schedule, "redistribute", k - 1), k + 1,
            "head")
      if k + 1 < s_bvn:
        balance_late()
        if k + 1 < 2:
          balance(k + 1, k + 1)
      if k + 2 < s_bvn:
        balance(k + 2, k + 1)
    if s_bvn > 1:
      run(ref._stage_of_kind(schedule, "redistribute", s_bvn - 2), s_bvn + 1,
          "tail")
    run(ref._stage_of_kind(schedule, "redistribute", s_bvn - 1), s_bvn + 1)
  if hold.segs or any(reserved.values()):
    key = next(iter(hold.segs or {k: v for k, v in reserved.items() if v}))
    raise ValueError(f"schedule leaves rows of flow {key[-2:]} on GPU {key[0]}")
  arr = np.asarray(ops, np.int64).reshape(-1, OP_COLS)
  num_phases = int(arr[:, PHASE].max()) + 1 if len(arr) else 0
  return ExecutionPlan(arr, num_phases, bump, n, m)


def check_plan(plan: ExecutionPlan, traffic, rows_in: int, rows_out: int,
               ws_rows: int) -> None:
  """Checks a plan's ops on buffers of the given sizes; raises ValueError.

  Every op reads and writes inside its buffers; within a phase no op reads
  a row another op of that phase writes (on the same GPU) and no two ops
  write the same row; over the whole plan every ``out`` row below the
  GPU's received total is written exactly once, by the right flow row, and
  nothing else.
  """
  t = np.asarray(traffic, np.int64)
  g = t.shape[0]
  ops = plan.ops
  ro = recv_offsets(t)
  written = [np.zeros(rows_out, np.int64) for _ in range(g)]
  sizes = {X: rows_in, WS: ws_rows}
  dst_sizes = {OUT: rows_out, WS: ws_rows}
  for p in range(plan.num_phases):
    reads, writes = {}, {}
    for op in ops[ops[:, PHASE] == p]:
      rows = int(op[ROWS])
      if rows <= 0:
        raise ValueError(f"op {op.tolist()}: empty")
      if not (0 <= op[SRC_ROW] and op[SRC_ROW] + rows <= sizes[op[SRC_BUF]]):
        raise ValueError(f"op {op.tolist()}: reads outside its buffer")
      if not (0 <= op[DST_ROW] and op[DST_ROW] + rows <= dst_sizes[op[DST_BUF]]):
        raise ValueError(f"op {op.tolist()}: writes outside its buffer")
      reads.setdefault((int(op[SRC]), int(op[SRC_BUF])), []).append(
          (int(op[SRC_ROW]), rows))
      writes.setdefault((int(op[DST]), int(op[DST_BUF])), []).append(
          (int(op[DST_ROW]), rows))
      if op[DST_BUF] == OUT:
        if op[DST] != op[FLOW_DST]:
          raise ValueError(f"op {op.tolist()}: writes out of a GPU that is "
                           "not the flow's destination")
        want = ro[op[FLOW_SRC], op[FLOW_DST]] + op[FLOW_ROW]
        if op[DST_ROW] != want:
          raise ValueError(f"op {op.tolist()}: lands at row {op[DST_ROW]}, "
                           f"not {want}")
        written[op[DST]][op[DST_ROW]:op[DST_ROW] + rows] += 1
    for (gpu, buf), ranges in writes.items():
      cover = np.zeros(dst_sizes[buf], np.int64)
      for r0, k in ranges:
        cover[r0:r0 + k] += 1
      if cover.max(initial=0) > 1:
        raise ValueError(f"phase {p}: GPU {gpu} writes a row twice")
      if buf == WS:
        for r0, k in reads.get((gpu, WS), []):
          if cover[r0:r0 + k].any():
            raise ValueError(f"phase {p}: GPU {gpu} reads a workspace row "
                             "written in the same phase")
  for d in range(g):
    total = int(t[:, d].sum())
    if not ((written[d][:total] == 1).all() and not written[d][total:].any()):
      raise ValueError(f"GPU {d}: out rows not written exactly once")

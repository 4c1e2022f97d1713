"""The C++ FAST scheduler (``moe_jax._fast``) behind the reference's API."""

from __future__ import annotations

import numpy as np

from moe_jax.fast import plan as pl
from moe_jax.fast import reference as ref

try:
  from moe_jax import _fast  # type: ignore[attr-defined]
except ImportError:  # extension not built
  _fast = None

_KINDS = ("balance", "intra")


def available() -> bool:
  return _fast is not None


def _require():
  if _fast is None:
    raise ImportError("moe_jax._fast is not built; run `pip install "
                      "--no-build-isolation -e .`")
  return _fast


def schedule_arrays(traffic, num_servers: int, gpus_per_server: int,
                    with_transfers: bool = True, gpu: int = -1,
                    ranges: bool = False) -> dict:
  """Raw C++ result: dict of numpy arrays (see xla_ffi/fast/scheduler.h).

  Keys: bound, server_matrix, padded_matrix, matchings, weights, real,
  transfers and redistribution (int64[K, 6] rows: stage, src, dst, amount,
  flow_src, flow_dst; stage 0 balance, 1 intra, 2 + 2k scale-out and
  3 + 2k redistribution of BvN stage k).  ``gpu >= 0`` keeps only the rows
  that GPU sends or receives (what one rank executes).  ``ranges``: the
  full schedule in its ranges form (``transfers`` holds the balancing rows
  alone, ``redistribution`` is empty; plus ``lane_units`` int64[G, n],
  ``pair_sent`` int64[S, n] and ``balance_begin`` int64[n * n + 1]);
  ``rows_from_ranges`` expands it.
  """
  t = ref._check_traffic(traffic, num_servers, gpus_per_server)
  return _require().schedule(np.ascontiguousarray(t), int(num_servers),
                             int(gpus_per_server), with_transfers, int(gpu),
                             bool(ranges))


def rows_from_ranges(traffic, d: dict) -> tuple[np.ndarray, np.ndarray]:
  """(transfers, redistribution) rows of a full schedule in the ranges form
  (``schedule_arrays(..., ranges=True)``), decoded here from its arrays and
  the traffic alone by the rule in xla_ffi/fast/scheduler.h; equal to the
  rows form's.  Lane l of pair (a, b) sends, in stage k, its queue units
  [c(x), c(x + real)) with x = pair_sent[k, a] and c(y) the units u < y
  with (u + a + b) % M == l; its queue is its own tile row (columns l,
  l + 1, .. mod M, zeros skipped) cut to min(have, want) units, then the
  balancing rows into it."""
  t = np.asarray(traffic, np.int64)
  server = d["server_matrix"]
  n = server.shape[0]
  g = t.shape[0]
  m = g // n
  units = d["lane_units"]
  bal = d["transfers"]
  begin = d["balance_begin"]
  queues = {}
  for a in range(n):
    for b in range(n):
      big = int(server[a, b])
      if a == b or big == 0:
        continue
      rows = bal[begin[a * n + b]:begin[a * n + b + 1]]
      for l in range(m):
        lane = a * m + l
        r = (l - a - b) % m
        want = (big - r + m - 1) // m if big > r else 0
        keep = min(int(units[lane, b]), want)
        q = []
        for h in [(l + i) % m for i in range(m)]:
          y = min(int(t[lane, b * m + h]), keep)
          if y > 0:
            q.append([lane, b * m + h, y])
          keep -= y
        q.extend([int(x[4]), int(x[5]), int(x[3])] for x in rows
                 if x[2] == lane)
        queues[(a, b, l)] = q
  transfers = [list(map(int, x)) for x in bal]
  for s in range(g):
    base = s // m * m
    for h in range(base, base + m):
      if h != s and t[s, h] > 0:
        transfers.append([1, s, h, int(t[s, h]), s, h])
  redistribution = []
  for k in range(d["weights"].shape[0]):
    for a in range(n):
      b = int(d["matchings"][k, a])
      x = int(d["real"][k, a])
      if a == b or x == 0:
        continue
      lo, hi = int(d["pair_sent"][k, a]), int(d["pair_sent"][k, a]) + x
      for l in range(m):
        r = (l - a - b) % m
        c0 = (lo + m - 1 - r) // m
        c1 = (hi + m - 1 - r) // m
        pos = 0
        src, dst = a * m + l, b * m + l
        for fs, fd, amount in queues[(a, b, l)]:
          y = min(pos + amount, c1) - max(pos, c0)
          pos += amount
          if y <= 0:
            continue
          transfers.append([2 + 2 * k, src, dst, y, fs, fd])
          if fd != dst:
            redistribution.append([3 + 2 * k, dst, fd, y, fs, fd])
  shape = (-1, 6)
  return (np.asarray(transfers, np.int64).reshape(shape),
          np.asarray(redistribution, np.int64).reshape(shape))


def workspace_use(traffic, num_servers: int, gpus_per_server: int
                  ) -> np.ndarray:
  """int64[G]: workspace rows each GPU's plan uses, computed in C++ from
  the full schedule's ranges form (what every rank checks when the
  workspace is below the proven bound); equals the execution plan's
  ``workspace_used``."""
  t = ref._check_traffic(traffic, num_servers, gpus_per_server)
  return _require().workspace_use(np.ascontiguousarray(t), int(num_servers),
                                  int(gpus_per_server))


def fast_schedule(traffic, num_servers: int, gpus_per_server: int
                  ) -> ref.Schedule:
  """Same as ``reference.fast_schedule``, computed in C++."""
  t = ref._check_traffic(traffic, num_servers, gpus_per_server)
  d = schedule_arrays(t, num_servers, gpus_per_server, True)
  s = int(d["weights"].shape[0])
  stages = [ref.Stage("balance", []), ref.Stage("intra", [])]
  for k in range(s):
    stages.append(ref.Stage("scale_out", [], k))
    stages.append(ref.Stage("redistribute", [], k))
  rows = np.concatenate([d["transfers"], d["redistribution"]]).tolist()
  for st, src, dst, amt, fs, fd in rows:
    stages[st].transfers.append(ref.Transfer(src, dst, amt, (fs, fd)))
  return ref.Schedule(int(num_servers), int(gpus_per_server), t,
                      d["server_matrix"], d["padded_matrix"], int(d["bound"]),
                      d["matchings"], d["weights"], d["real"], stages)


def time_schedule(traffic, num_servers: int, gpus_per_server: int,
                  repeats: int, with_transfers: bool = True,
                  gpu: int = -1, ranges: bool = False) -> np.ndarray:
  """float64[repeats]: C++ wall time of each scheduler run, nanoseconds
  (``ranges``: the full schedule in its ranges form)."""
  t = ref._check_traffic(traffic, num_servers, gpus_per_server)
  return _require().time_schedule(np.ascontiguousarray(t), int(num_servers),
                                  int(gpus_per_server), int(repeats),
                                  with_transfers, int(gpu), bool(ranges))


def time_schedule_each(traffics, num_servers: int, gpus_per_server: int,
                       with_transfers: bool = True, gpu: int = -1,
                       buffers: str = "warm",
                       ranges: bool = False) -> np.ndarray:
  """float64[K]: C++ wall time (ns) of one scheduler run on each of the K
  matrices ``traffics`` [K, G, G].  ``buffers``: ``"warm"`` one scheduler
  reused; ``"cold"`` the same after 64 MiB of other writes before each
  run (cold caches); ``"new"`` a new scheduler and output per run after
  those writes (allocated and first touched inside the run).  ``ranges``:
  the full schedule in its ranges form."""
  modes = ("warm", "cold", "new")
  if buffers not in modes:
    raise ValueError(f"buffers must be one of {modes}, got {buffers!r}")
  ts = np.stack([ref._check_traffic(t, num_servers, gpus_per_server)
                 for t in traffics])
  return _require().time_schedule_each(
      np.ascontiguousarray(ts), int(num_servers), int(gpus_per_server),
      with_transfers, int(gpu), modes.index(buffers), bool(ranges))


def spreadout_time(matrix) -> int:
  x = np.ascontiguousarray(np.asarray(matrix, np.int64))
  if x.ndim != 2 or x.shape[0] != x.shape[1]:
    raise ValueError(f"matrix must be square, got shape {x.shape}")
  return int(_require().spreadout_time(x))


def execution_plan(traffic, num_servers: int, gpus_per_server: int
                   ) -> pl.ExecutionPlan:
  """Same as ``plan.execution_plan``, computed in C++ (xla_ffi/fast/plan.cc:
  the code the CUDA custom call runs)."""
  t = ref._check_traffic(traffic, num_servers, gpus_per_server)
  d = _require().plan(np.ascontiguousarray(t), int(num_servers),
                      int(gpus_per_server))
  return pl.ExecutionPlan(d["ops"], int(d["num_phases"]), d["workspace_used"],
                          int(num_servers), int(gpus_per_server))


def rank_program(traffic, num_servers: int, gpus_per_server: int, rank: int,
                 per_rank: bool = True) -> dict:
  """One rank's program (xla_ffi/fast/plan.h's RankProgram).

  ``per_rank``: built from the rank's per-GPU schedule alone, as the CUDA
  custom call builds it; else extracted from the whole plan.  Returns a
  dict: ``ops`` int64[K, 7] in issue order (kind 0 copy / 1 send / 2
  receive, peer, rows, src buffer, src row, dst buffer, dst row; -1 on the
  peer's side of a send or receive), ``phase_begin`` int64[P + 1] (the ops
  of phase p are ``ops[phase_begin[p]:phase_begin[p + 1]]``),
  ``recv_total`` and ``workspace_used``.
  """
  t = ref._check_traffic(traffic, num_servers, gpus_per_server)
  return _require().rank_program(np.ascontiguousarray(t), int(num_servers),
                                 int(gpus_per_server), int(rank),
                                 bool(per_rank))


def time_rank_program(traffic, num_servers: int, gpus_per_server: int,
                      rank: int, repeats: int, per_rank: bool = True,
                      below_bound: bool = False) -> np.ndarray:
  """float64[repeats]: C++ wall time (ns) of what the custom call computes
  per call on ``rank``: traffic check, schedule, plan and the rank's
  program, with buffers that just fit the traffic and the default
  workspace (``below_bound``: one row less, where every rank checks every
  rank's workspace use); from the rank's per-GPU schedule (``per_rank``)
  or the whole plan."""
  t = ref._check_traffic(traffic, num_servers, gpus_per_server)
  return _require().time_rank_program(np.ascontiguousarray(t),
                                      int(num_servers), int(gpus_per_server),
                                      int(rank), int(repeats), bool(per_rank),
                                      bool(below_bound))


def simulate_execution(traffic, num_servers: int, gpus_per_server: int, x,
                       rows_out: int, ws_rows: int) -> np.ndarray:
  """Every rank's staged all-to-all program, issued as on the GPU (issue.h)
  over an in-memory NCCL stand-in (xla_ffi/fast/simulate.h).

  Args:
    traffic: int[G, G] rows per flow.
    x: [G, rows_in, ...] any dtype: each rank's send rows.
    rows_out, ws_rows: rows of each rank's out and workspace buffers.
  Returns:
    [G, rows_out, ...] x.dtype: each rank's out buffer.
  Raises:
    ValueError: unmatched sends/receives, hazards, undelivered rows, or
      buffers too small for the traffic.
  """
  t = ref._check_traffic(traffic, num_servers, gpus_per_server)
  x = np.ascontiguousarray(x)
  if x.ndim < 2 or x.shape[0] != t.shape[0]:
    raise ValueError(f"x must have shape [G={t.shape[0]}, rows_in, ...], "
                     f"got {x.shape}")
  rows_in = x.shape[1]
  tail = x.shape[2:]
  raw = x.reshape(x.shape[0], rows_in, -1).view(np.uint8)
  if rows_in == 0 or raw.shape[2] == 0:
    raw = np.zeros((x.shape[0], rows_in, max(1, x.dtype.itemsize * int(
        np.prod(tail, dtype=np.int64)))), np.uint8)
  out = _require().simulate_execution(np.ascontiguousarray(t), int(num_servers),
                                      int(gpus_per_server),
                                      np.ascontiguousarray(raw),
                                      int(rows_out), int(ws_rows))
  return out.view(x.dtype).reshape((x.shape[0], int(rows_out)) + tail)

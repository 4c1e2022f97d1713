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
                    with_transfers: bool = True, gpu: int = -1) -> dict:
  """Raw C++ result: dict of numpy arrays (see xla_ffi/fast/scheduler.h).

  Keys: bound, server_matrix, padded_matrix, matchings, weights, real,
  transfers and redistribution (int64[K, 6] rows: stage, src, dst, amount,
  flow_src, flow_dst; stage 0 balance, 1 intra, 2 + 2k scale-out and
  3 + 2k redistribution of BvN stage k).  ``gpu >= 0`` keeps only the rows
  that GPU sends or receives (what one rank executes).
  """
  t = ref._check_traffic(traffic, num_servers, gpus_per_server)
  return _require().schedule(np.ascontiguousarray(t), int(num_servers),
                             int(gpus_per_server), with_transfers, int(gpu))


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
                  gpu: int = -1) -> np.ndarray:
  """float64[repeats]: C++ wall time of each scheduler run, nanoseconds."""
  t = ref._check_traffic(traffic, num_servers, gpus_per_server)
  return _require().time_schedule(np.ascontiguousarray(t), int(num_servers),
                                  int(gpus_per_server), int(repeats),
                                  with_transfers, int(gpu))


def time_schedule_each(traffics, num_servers: int, gpus_per_server: int,
                       with_transfers: bool = True, gpu: int = -1,
                       buffers: str = "warm") -> np.ndarray:
  """float64[K]: C++ wall time (ns) of one scheduler run on each of the K
  matrices ``traffics`` [K, G, G].  ``buffers``: ``"warm"`` one scheduler
  reused; ``"cold"`` the same after 64 MiB of other writes before each
  run (cold caches); ``"new"`` a new scheduler and output per run after
  those writes (allocated and first touched inside the run)."""
  modes = ("warm", "cold", "new")
  if buffers not in modes:
    raise ValueError(f"buffers must be one of {modes}, got {buffers!r}")
  ts = np.stack([ref._check_traffic(t, num_servers, gpus_per_server)
                 for t in traffics])
  return _require().time_schedule_each(
      np.ascontiguousarray(ts), int(num_servers), int(gpus_per_server),
      with_transfers, int(gpu), modes.index(buffers))


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

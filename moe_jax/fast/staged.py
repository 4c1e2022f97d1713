"""Staged (FAST-scheduled) all-to-all(v) from jit, and its reference.

Inside ``jax.shard_map`` over ``axis_name`` (P ranks), every rank holds rows
``x [R, ...]`` grouped by destination (``send_counts[d]`` rows for rank d,
in rank order) and gets the rows sent to it grouped by source, in a fixed
buffer ``out [R_out, ...]`` plus ``recv_counts [P]``: the semantics of a
ragged all-to-all.  ``staged_all_to_all`` moves the rows along the FAST
schedule of the P x P traffic matrix (all-gathered inside jit) on a
two-tier ``Topology``; the result is bitwise the one of
``reference_all_to_all`` (a direct exchange), whatever the path.

Implementations (``impl``):

  custom_call  GPU: one CUDA custom call; the host schedules and issues
               NCCL send/recv on XLA's communicator (staged_ffi.py).
  callback     any backend: jax.pure_callback computes the schedule, a loop
               of ragged all-to-alls executes it (staged_callback.py).
  reference    the direct exchange from all-gathers (graph-capturable).
  auto         custom_call on GPU when built, else callback.

Neither custom_call nor callback is graph-capturable (both go through the
host every call); the all-gather of the counts and everything else around
them is.

Rows that do not fit are dropped in a fixed order, the same on every path
(``effective_traffic``): a sender's rows past R (destinations in order),
then a receiver's rows past R_out (sources in order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import custom_calls
from moe_jax.fast import plan as pl
from moe_jax.fast import staged_callback, staged_ffi
from moe_jax.fast.topology import Topology, detect_topology

IMPLS = ("auto", "custom_call", "callback", "reference")
TRANSPORTS = ("auto",) + staged_callback.TRANSPORTS
_NAME = "staged_all_to_all"


def _fail(arg: str, message: str):
  raise ValueError(f"{_NAME}: argument '{arg}' {message}")


def effective_traffic(counts, rows_in: int, rows_out: int):
  """int32[P, P]: ``plan.effective_traffic`` in jnp (same clamping)."""
  c = jnp.clip(counts.astype(jnp.int32), 0, rows_in)
  cum = jnp.cumsum(c, axis=1)
  c = jnp.minimum(cum, rows_in) - jnp.minimum(cum - c, rows_in)
  cum = jnp.cumsum(c, axis=0)
  return jnp.minimum(cum, rows_out) - jnp.minimum(cum - c, rows_out)


def _check(x, send_counts, axis_name, out_rows):
  try:
    num_ranks = jax.lax.axis_size(axis_name)
  except (NameError, KeyError, ValueError) as err:
    _fail("axis_name", f"must name a shard_map axis, got {axis_name!r} ({err})")
  if x.ndim < 1 or x.shape[0] < 1:
    _fail("x", f"must be [R >= 1, ...], got shape {tuple(x.shape)}")
  if jax.dtypes.itemsize_bits(x.dtype) % 8:
    _fail("x", f"must have a whole-byte dtype, got {x.dtype}")
  if (send_counts.shape != (num_ranks,)
      or not jnp.issubdtype(send_counts.dtype, jnp.integer)):
    _fail("send_counts", f"must be an integer [P={num_ranks}] array, got "
          f"{send_counts.dtype}{list(send_counts.shape)}")
  out_rows = x.shape[0] if out_rows is None else out_rows
  if not isinstance(out_rows, (int, np.integer)) or out_rows < 1:
    _fail("out_rows", f"must be a positive int, got {out_rows!r}")
  return num_ranks, int(out_rows)


def _resolve_topology(topology, num_ranks, platform):
  if topology is None:
    if platform == "cpu":
      return Topology(1, num_ranks, "default", "CPU devices")
    return detect_topology(num_ranks)
  if isinstance(topology, str):
    topology = Topology.parse(topology)
  if not isinstance(topology, Topology):
    _fail("topology", f"must be a Topology, 'NxM' or None, got {topology!r}")
  if topology.num_gpus != num_ranks:
    _fail("topology", f"{topology} has {topology.num_gpus} GPUs but the axis "
          f"has {num_ranks} ranks")
  return topology


def _resolve_impl(impl, transport, platform):
  if impl not in IMPLS:
    _fail("impl", f"must be one of {IMPLS}, got {impl!r}")
  if transport not in TRANSPORTS:
    _fail("transport", f"must be one of {TRANSPORTS}, got {transport!r}")
  gpu = platform in ("gpu", "cuda")
  if impl == "auto":
    impl = "custom_call" if gpu and staged_ffi.available() else "callback"
  if impl == "custom_call" and not gpu:
    _fail("impl", f"'custom_call' runs on GPUs only (platform {platform!r}); "
          "use 'callback' (the CPU all-to-all) or 'reference'")
  if transport == "auto":
    transport = "lax" if gpu else "custom_call"
    if not gpu and custom_calls.ALL_TO_ALL not in custom_calls.register().get("cpu", ()):
      transport = "reference"
  if transport == "lax" and not gpu:
    _fail("transport", "'lax' (lax.ragged_all_to_all) is not supported by "
          "XLA:CPU; use 'custom_call' or 'reference'")
  return impl, transport


def reference_all_to_all(x, send_counts, *, axis_name: str,
                         out_rows: int | None = None):
  """The direct ragged all-to-all, from all-gathers (inside shard_map).

  Args / returns as ``staged_all_to_all``.  Graph-capturable.
  """
  num_ranks, out_rows = _check(x, send_counts, axis_name, out_rows)
  rows_in = x.shape[0]
  traffic = effective_traffic(jax.lax.all_gather(send_counts, axis_name),
                              rows_in, out_rows)
  return _direct(x, traffic, axis_name, out_rows), _recv_counts(traffic, axis_name)


def _recv_counts(traffic, axis_name):
  return traffic[:, jax.lax.axis_index(axis_name)]


def _direct(x, traffic, axis_name, out_rows):
  num_ranks, rows_in = traffic.shape[0], x.shape[0]
  me = jax.lax.axis_index(axis_name)
  x_all = jax.lax.all_gather(x, axis_name)                  # [P, R, ...]
  send_off = jnp.cumsum(traffic, axis=1) - traffic          # [P, P]
  recv = traffic[:, me]
  recv_end = jnp.cumsum(recv)
  i = jnp.arange(out_rows, dtype=jnp.int32)
  src = jnp.minimum(jnp.searchsorted(recv_end, i, side="right"), num_ranks - 1)
  row = send_off[src, me] + i - (recv_end[src] - recv[src])
  rows = x_all[src, jnp.clip(row, 0, rows_in - 1)]
  valid = (i < recv_end[-1]).reshape((out_rows,) + (1,) * (x.ndim - 1))
  return jnp.where(valid, rows, jnp.zeros((), x.dtype))


def staged_all_to_all(x, send_counts, *, axis_name: str,
                      topology: Topology | str | None = None,
                      out_rows: int | None = None, impl: str = "auto",
                      transport: str = "auto", planner: str = "auto",
                      workspace_rows: int | None = None,
                      platform: str | None = None):
  """All-to-all(v) of row ranges along the FAST schedule (inside shard_map).

  Args:
    x: [R, ...] any whole-byte dtype: the rows to send, grouped by
      destination rank (the first send_counts[0] go to rank 0, ...).
    send_counts: integer [P]: rows for each rank.
    axis_name: the shard_map axis (P ranks).
    topology: Topology (or "NxM") with N * M == P: rank r is local GPU
      r % M of server r // M (several servers can be emulated on one host).
      None: detected from ``nvidia-smi topo -m`` on GPUs (NVLink islands),
      one server on CPU.
    out_rows: static rows of the result (default R).
    impl: "auto", "custom_call", "callback" or "reference" (module doc).
    transport: of the callback path: "auto" (GPU "lax", CPU "custom_call"
      when built, else "reference"), "lax", "custom_call" or "reference".
    planner: of the callback path: "auto" (C++ when built), "cpp", "python".
    workspace_rows: static rows of the relay workspace (each rank, x's row
      shape and dtype).  Default: ``plan.workspace_rows``, enough for any
      counts; a smaller value saves memory and makes a call whose plan
      needs more fail on every rank alike (an error, not a hang).
    platform: "cpu" or "gpu" (default: jax.default_backend()).
  Returns:
    out: [out_rows, ...] x.dtype: received rows grouped by source rank in
      rank order, each source's rows in its send order; zero past the total.
    recv_counts: int32[P]: rows received from each rank.
  Raises:
    ValueError (at trace time) naming the offending argument.
  Graph-capturable: only with impl="reference".
  """
  num_ranks, out_rows = _check(x, send_counts, axis_name, out_rows)
  platform = (platform or jax.default_backend()).lower()
  impl, transport = _resolve_impl(impl, transport, platform)
  if planner not in staged_callback.PLANNERS:
    _fail("planner", f"must be one of {staged_callback.PLANNERS}, got {planner!r}")
  topology = _resolve_topology(topology, num_ranks, platform)
  rows_in = x.shape[0]
  traffic = effective_traffic(jax.lax.all_gather(send_counts, axis_name),
                              rows_in, out_rows)
  recv_counts = _recv_counts(traffic, axis_name)
  if impl == "reference":
    return _direct(x, traffic, axis_name, out_rows), recv_counts
  ws_rows = pl.workspace_rows(rows_in, out_rows, topology.num_servers,
                              topology.gpus_per_server)
  if workspace_rows is not None:
    if not isinstance(workspace_rows, (int, np.integer)) or workspace_rows < 0:
      _fail("workspace_rows", f"must be a non-negative int, got {workspace_rows!r}")
    ws_rows = int(workspace_rows)
  kw = dict(axis_name=axis_name, topology=topology, out_rows=out_rows,
            ws_rows=ws_rows)
  if impl == "custom_call":
    out = staged_ffi.ffi_all_to_all(x, traffic, **kw)
  else:
    out = staged_callback.callback_all_to_all(x, traffic, transport=transport,
                                              planner=planner, **kw)
  return out, recv_counts

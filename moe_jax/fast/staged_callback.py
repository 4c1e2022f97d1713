"""The staged all-to-all through jax.pure_callback and ragged all-to-alls.

The host computes the FAST schedule and its execution plan (C++ or Python,
``planner``) inside a ``jax.pure_callback`` and returns this rank's phase
arrays (moe_jax.fast.phases); a ``fori_loop`` over the phases then gathers
the send rows, moves them with one ragged all-to-all per phase and
scatters them into ``out`` or the workspace.  Rows are only copied (never
combined), so the result is bit-identical to a direct ragged all-to-all.

Transports of the per-phase ragged all-to-all: "lax"
(``lax.ragged_all_to_all``; GPU, not supported by XLA:CPU), "custom_call"
(moe_jax's CPU all-to-all custom call; one mesh axis only) and "reference"
(``refs.ragged_all_to_all``, all-gather based; any backend).

Not graph-capturable: the callback is a host round trip every call.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import custom_calls, manual_axes
from moe_jax.fast import cpp
from moe_jax.fast import phases as ph
from moe_jax.fast import plan as pl
from moe_jax.fast.topology import Topology

TRANSPORTS = ("lax", "custom_call", "reference")
PLANNERS = ("auto", "cpp", "python")

_lock = threading.Lock()


@functools.lru_cache(maxsize=32)
def _cached_plan(traffic_bytes: bytes, g: int, n: int, m: int,
                 planner: str) -> pl.ExecutionPlan:
  t = np.frombuffer(traffic_bytes, np.int32).reshape(g, g).astype(np.int64)
  if planner == "cpp" or (planner == "auto" and cpp.available()):
    return cpp.execution_plan(t, n, m)
  return pl.execution_plan(t, n, m)


def host_phase_arrays(traffic, rank, *, num_servers: int,
                      gpus_per_server: int, rows_in: int, rows_out: int,
                      ws_rows: int, phases: int, send_cap: int, recv_cap: int,
                      planner: str) -> tuple:
  """Host side: (traffic int32[P, P], rank) -> PhaseArrays fields.

  Every rank calls this with the same traffic; the plan is computed once
  and cached (per traffic matrix, a few recent ones).
  """
  t = np.ascontiguousarray(np.asarray(traffic, np.int32))
  g = t.shape[0]
  with _lock:
    plan = _cached_plan(t.tobytes(), g, num_servers, gpus_per_server, planner)
  # Decided on the whole plan, so every rank fails alike (none is left
  # waiting in a collective for one that stopped).
  need = int(plan.workspace_used.max(initial=0))
  if need > ws_rows:
    raise ValueError(f"staged_all_to_all: this traffic needs {need} workspace "
                     f"rows on some rank, workspace_rows is {ws_rows}")
  arrs = ph.phase_arrays(plan, int(rank), rows_in, rows_out, ws_rows, phases,
                         send_cap, recv_cap)
  return arrs.as_tuple()


def _exchange(send, p, arrs: ph.PhaseArrays, recv_cap: int, axis_name: str,
              transport: str):
  """One phase's ragged all-to-all: [NS, ...] -> [NR, ...]."""
  if transport == "lax":
    out = jnp.zeros((recv_cap,) + send.shape[1:], send.dtype)
    return jax.lax.ragged_all_to_all(
        send, out, arrs.send_offsets[p], arrs.send_sizes[p],
        arrs.out_offsets[p], arrs.recv_sizes[p], axis_name=axis_name)
  recv, _ = custom_calls.ragged_all_to_all(
      send, arrs.send_offsets[p], arrs.send_sizes[p], arrs.recv_offsets[p],
      recv_rows=recv_cap, axis_name=axis_name,
      impl="reference" if transport == "reference" else "custom_call")
  return recv


def callback_all_to_all(x, traffic, *, axis_name: str, topology: Topology,
                        out_rows: int, ws_rows: int, transport: str,
                        planner: str = "auto"):
  """Executes the staged all-to-all of ``traffic`` inside shard_map.

  Args:
    x: [R, ...] this rank's send rows (grouped by destination).
    traffic: int32[P, P] effective traffic, the same on every rank.
    topology: num_gpus == P.
    out_rows, ws_rows: static rows of the result and of the workspace.
    transport: one of TRANSPORTS; planner: one of PLANNERS.
  Returns:
    [out_rows, ...] x.dtype, rows grouped by source, zero past the total.
  """
  rows_in = x.shape[0]
  num_ranks = traffic.shape[0]
  phases = pl.max_phases(topology.num_servers)
  send_cap, recv_cap = rows_in + ws_rows, out_rows + ws_rows
  shapes = ph.shapes(num_ranks, phases, send_cap, recv_cap)
  result = tuple(jax.ShapeDtypeStruct(s, jnp.int32) for s in shapes.values())
  host = functools.partial(
      host_phase_arrays, num_servers=topology.num_servers,
      gpus_per_server=topology.gpus_per_server, rows_in=rows_in,
      rows_out=out_rows, ws_rows=ws_rows, phases=phases, send_cap=send_cap,
      recv_cap=recv_cap, planner=planner)
  rank = jax.lax.axis_index(axis_name).astype(jnp.int32)
  arrs = ph.PhaseArrays(*jax.pure_callback(host, result, traffic, rank,
                                           vmap_method="sequential"))
  tail = x.shape[1:]

  def phase(p, carry):
    out, ws = carry
    send = jnp.take(jnp.concatenate([x, ws]), arrs.send_rows[p], axis=0)
    recv = _exchange(send, p, arrs, recv_cap, axis_name, transport)
    dst = jnp.concatenate([out, ws]).at[arrs.recv_rows[p]].set(recv, mode="drop")
    return dst[:out_rows], dst[out_rows:]

  out = jnp.zeros((out_rows,) + tail, x.dtype)
  ws = jnp.zeros((ws_rows,) + tail, x.dtype)
  out = manual_axes.as_varying(out, manual_axes.varying_axes(x) | {axis_name})
  ws = manual_axes.as_varying(ws, manual_axes.varying_axes(x) | {axis_name})
  out, _ = jax.lax.fori_loop(0, arrs.num_phases, phase, (out, ws))
  return out

"""The staged (FAST) all-to-all as a differentiable transport of the layer.

`fast_all_to_all` is `staged.staged_all_to_all` with a VJP: the transpose
of an all-to-all is the reverse all-to-all with the same counts, so the
gradient of the received rows travels back along the FAST schedule of the
transposed traffic matrix (each receiver sends the cotangents of the rows
it received, grouped by source, to their sources, where they land on the
rows they were sent from; rows that were sent nowhere get zero). The
reverse's buffers are the forward's swapped, so it never drops a row the
forward delivered.

Rows are only copied on both paths (NCCL send/recv or gathers, scatters
and ragged all-to-alls), so forward and gradient are bitwise those of a
direct ragged all-to-all of the same rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from moe_jax import manual_axes
from moe_jax.fast import staged
from moe_jax.fast.topology import Topology


class _Static(NamedTuple):
    axis_name: str
    topology: Topology
    rows_in: int
    rows_out: int
    impl: str
    platform: str


def fast_all_to_all(x: jax.Array, send_counts: jax.Array, *, axis_name: str,
                    topology: Topology, out_rows: int, platform: str,
                    impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Ragged all-to-all of contiguous row groups along the FAST schedule.

    Call inside `jax.shard_map` over `axis_name` (P ranks).

    Args:
      x: [R, ...] any whole-byte dtype; rows grouped by destination rank from
        row 0 (the first send_counts[0] rows go to rank 0, ...).
      send_counts: int32 [P] rows for each rank; sum <= R.
      topology: servers x GPUs per server, num_gpus == P.
      out_rows: static rows of the result; the caller sizes it for the most
        any rank can receive (rows past it would be dropped by the staged
        all-to-all's clamping; the layer's buffers are the worst case).
      platform: "cpu" or "gpu".
      impl: of `staged_all_to_all`: "auto" (the CUDA custom call on GPUs when
        built, else the host-planned callback path), "callback" or
        "reference" (the direct exchange, for comparison).
    Returns:
      (out [out_rows, ...] x.dtype: rows received, grouped by source rank,
       zero past the received total; recv_counts int32 [P]).
    Differentiable in x (the VJP above). Not graph-capturable unless
    impl="reference": the plan is built on the host every call.
    """
    static = _Static(axis_name, topology, int(x.shape[0]), int(out_rows), impl, platform)
    x, send_counts = manual_axes.same_varying(x, send_counts, extra_axes=(axis_name,))
    return _fast(static, x, send_counts)


def _call(static: _Static, x, send_counts, rows_out: int):
    return staged.staged_all_to_all(x, send_counts, axis_name=static.axis_name,
                                    topology=static.topology, out_rows=rows_out,
                                    impl=static.impl, platform=static.platform)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fast(static, x, send_counts):
    return _call(static, x, send_counts, static.rows_out)


def _fast_fwd(static, x, send_counts):
    out, recv_counts = _call(static, x, send_counts, static.rows_out)
    return (out, recv_counts), recv_counts


def _fast_bwd(static, recv_counts, cotangents):
    """Each rank sends the cotangents of the rows it received (grouped by
    source) back to their sources: the staged all-to-all of the transposed
    traffic, into buffers of the forward's input rows."""
    d_out, _ = cotangents
    d_x, _ = _call(static, d_out, recv_counts, static.rows_in)
    return d_x, None


_fast.defvjp(_fast_fwd, _fast_bwd)

"""Strategies over the count-aware NVLink transport (moe_jax/nvlink.py).

One kernel pair moves exactly the rows that exist, so "ragged" and both
passes of "cap_and_spill" become the same transfer: there is no padding,
no spill window and no fallback to guard (the receive buffers hold the
worst case). With ctx.dispatch_fp8 the rows travel as e4m3 with per-128
scales and reach the expert function dequantized. Capacity and spill only shape the stats, which say how many
rows a two-pass dispatch would have spilled.

Differentiable (moe_jax/nvlink_grad.py): the backward runs the same
kernels in the other direction; with fp8 the quantization's gradient is
the identity (straight-through).
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_jax import nvlink
from moe_jax.dispatch.context import DispatchContext
from moe_jax.dispatch.passes import Delivered, call_experts
from moe_jax.dispatch.stats import stream_stats
from moe_jax.ordered_grads import SourceSizes
from moe_jax.plan import drop_invalid_picks


def nvlink_dispatch_combine(x, expert_ids, weights, expert_fn, *, strategy: str,
                            ctx: DispatchContext, experts_per_rank: int, capacity=None,
                            spill_capacity=None, return_delivered: bool = False):
    """Returns (out [T, H] in x.dtype, DispatchStats, Delivered or None)."""
    ids = drop_invalid_picks(expert_ids, ctx.num_ranks * experts_per_rank)
    channel, got = nvlink.dispatch_dequantized(
        x, ids, experts_per_rank=experts_per_rank, axis_name=ctx.axis_name,
        mesh_devices=ctx.mesh_devices, fp8=ctx.dispatch_fp8)
    # Rows come grouped by local expert, then source rank (canonical order).
    from_sources = jnp.take(got.all_counts, ctx.rank(), axis=1).T.astype(jnp.int32)
    y = call_experts(expert_fn, got.rows, got.group_sizes,
                     SourceSizes(from_sources, x.shape[0])).astype(x.dtype)
    out = nvlink.combine(channel, y, got, ids, weights, axis_name=ctx.axis_name)
    peer_counts = jnp.sum(got.all_counts, axis=2)
    num_slots = ctx.num_ranks * ids.size
    if strategy == "cap_and_spill":
        stats = stream_stats(peer_counts, capacity, channel.rows, num_slots=num_slots)
    else:
        stats = stream_stats(peer_counts, num_slots=num_slots)
    delivered = None
    if return_delivered:
        valid = jnp.arange(channel.rows) < jnp.sum(got.group_sizes)
        rows = jnp.where(valid[:, None], got.rows, jnp.zeros((), got.rows.dtype))
        delivered = Delivered(rows, valid, got.group_sizes)
    return out, stats, delivered

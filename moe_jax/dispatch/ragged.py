"""ragged: only the real rows cross ranks (ragged all-to-all both ways).

Receive buffers are sized for the worst case (P * T * min(k, E_local) rows)
so shapes stay static; the bytes moved are the actual rows.
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_jax.dispatch.context import DispatchContext
from moe_jax.dispatch.passes import deliver, locate_rows, run_experts, window_positions
from moe_jax.dispatch.stats import stream_stats
from moe_jax.ordered_grads import SourceSizes
from moe_jax.plan import DROPPED_POS, exclusive_cumsum, worst_case_rows_per_peer


def ragged(x, weights, plan, ctx: DispatchContext, expert_fn, *, recv_expert_counts,
           peer_counts, delivered_rows=None, **_):
    num_ranks, num_local = plan.num_ranks, plan.experts_per_rank
    num_slots = plan.sorted_slots.shape[0]
    recv_rows = num_ranks * worst_case_rows_per_peer(x.shape[0], plan.top_k, num_local)
    # All kept slots in stream order: a one-destination pack of the whole stream.
    whole = jnp.sum(plan.send_counts, keepdims=True).astype(jnp.int32)
    send, no_spill = ctx.pack(x, plan.sorted_slots, jnp.zeros((1,), jnp.int32), whole,
                              top_k=plan.top_k, start=0, capacity=num_slots, spill_capacity=0)
    recv_counts = jnp.sum(recv_expert_counts, axis=1).astype(jnp.int32)
    recv_offsets = exclusive_cumsum(recv_counts)
    # Streams lie one after the other on both sides (send_offsets and
    # recv_offsets are the exclusive sums of the counts).
    rows, _ = ctx.grouped_all_to_all(send[0], plan.send_counts, recv_counts, recv_rows)
    r = jnp.arange(recv_rows, dtype=jnp.int32)
    src = jnp.clip(jnp.sum(r[:, None] >= (recv_offsets + recv_counts)[None, :], axis=1),
                   0, num_ranks - 1).astype(jnp.int32)
    q = r - recv_offsets[src]
    pos, group_sizes, in_window = window_positions(src, q, recv_expert_counts, start=0,
                                                   width=recv_rows)
    out_rows = run_experts(rows, pos, group_sizes, expert_fn,
                           sources=SourceSizes(in_window.T, x.shape[0]))
    back, _ = ctx.grouped_all_to_all(out_rows, recv_counts, plan.send_counts, num_slots)
    stream_pos = jnp.where(plan.pos == DROPPED_POS, DROPPED_POS,
                           plan.send_offsets[plan.dest] + plan.pos)
    out = ctx.combine(back[None], no_spill, jnp.zeros_like(plan.dest), stream_pos, weights,
                      start=0, out_dtype=jnp.float32)
    delivered = None
    if delivered_rows is not None:
        _, canonical = locate_rows(src, q, recv_expert_counts)
        delivered = deliver(rows, canonical, recv_expert_counts, delivered_rows)
    return out, stream_stats(peer_counts, num_slots=num_slots * num_ranks), delivered

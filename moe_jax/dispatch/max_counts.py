"""max_counts: one exchange with per-peer buffers padded to the true worst case."""

from __future__ import annotations

from moe_jax.dispatch.context import DispatchContext
from moe_jax.dispatch.passes import window_pass
from moe_jax.dispatch.stats import stream_stats
from moe_jax.plan import worst_case_rows_per_peer


def max_counts(x, weights, plan, ctx: DispatchContext, expert_fn, *, recv_expert_counts,
               peer_counts, delivered_rows=None, **_):
    """Pass at capacity T * min(k, E_local): no routing can overflow it."""
    worst = worst_case_rows_per_peer(x.shape[0], plan.top_k, plan.experts_per_rank)
    out, delivered = window_pass(x, weights, plan, recv_expert_counts, ctx, expert_fn,
                                 start=0, capacity=worst, delivered_rows=delivered_rows)
    return out, stream_stats(peer_counts, num_slots=plan.num_slots * ctx.num_ranks), delivered

"""dense: every expert on one rank, no expert parallelism. The reference.

Over a mesh (moe_layer) every rank runs this on its own tokens."""

from __future__ import annotations

from moe_jax.dispatch.context import DispatchContext
from moe_jax.dispatch.passes import window_pass
from moe_jax.dispatch.stats import stream_stats


def dense(x, weights, plan, ctx: DispatchContext, expert_fn, *, peer_counts,
          delivered_rows=None, **_):
    """All T * k rows in one window of the single rank's stream."""
    if plan.num_ranks != 1:
        raise ValueError(f"strategy 'dense' runs on one rank, got a plan for {plan.num_ranks}")
    num_slots = plan.sorted_slots.shape[0]
    out, delivered = window_pass(x, weights, plan, plan.send_expert_counts, ctx, expert_fn,
                                 start=0, capacity=num_slots, delivered_rows=delivered_rows)
    return out, stream_stats(peer_counts, num_slots=num_slots), delivered

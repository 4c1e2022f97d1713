"""cap_and_spill: pass 1 at capacity C, pass 2 at S, an exact fallback beyond.

Both passes always run with fixed shapes. Streams longer than C + S (rare
when C and S come from calibration) are finished by a third pass under
`lax.cond`; its predicate comes from the (source, destination) counts every
rank all-gathered, so every rank takes the same branch and the collectives
inside stay matched. On GPU, XLA reads that predicate on the host
(docs/design/cap_and_spill_fallback.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax.dispatch.context import DispatchContext
from moe_jax.dispatch.passes import merge_delivered, window_pass
from moe_jax.dispatch.stats import stream_stats
from moe_jax.plan import worst_case_rows_per_peer


def cap_and_spill(x, weights, plan, ctx: DispatchContext, expert_fn, *, recv_expert_counts,
                  capacity: int, spill_capacity: int, peer_counts, delivered_rows=None,
                  _measure_without_fallback: bool = False, **_):
    """`_measure_without_fallback` drops the exact fallback (inexact; only for
    measuring what the fallback's guard costs)."""
    worst = worst_case_rows_per_peer(x.shape[0], plan.top_k, plan.experts_per_rank)
    cap = min(capacity, worst)
    spill = min(spill_capacity, worst - cap)
    out, delivered = window_pass(x, weights, plan, recv_expert_counts, ctx, expert_fn,
                                 start=0, capacity=cap, spill_capacity=spill,
                                 delivered_rows=delivered_rows)
    stats = stream_stats(peer_counts, cap, spill, num_slots=plan.num_slots * ctx.num_ranks)
    residual = worst - cap - spill
    if residual == 0 or _measure_without_fallback:
        return out, stats, delivered

    chain = ctx.chain_state()
    # The NCCL custom call does not run inside a captured conditional (XLA
    # records a command at most once); the rare fallback uses XLA's own.
    fallback_ctx = ctx if ctx.platform == "cpu" else dataclasses.replace(ctx, transport="lax")

    def fallback(_):
        ctx.restore_chain(chain)
        return window_pass(x, weights, plan, recv_expert_counts, fallback_ctx, expert_fn,
                           start=cap + spill, capacity=residual,
                           delivered_rows=delivered_rows)

    def skip(_):
        zero = jnp.zeros_like(out)
        if delivered_rows is None:
            return zero, None
        return zero, jax.tree.map(jnp.zeros_like, delivered)

    extra, extra_delivered = jax.lax.cond(stats.fallback_steps > 0, fallback, skip, None)
    ctx.restore_chain(chain)
    extra = ctx.chain_after(extra)
    return out + extra, stats, merge_delivered(delivered, extra_delivered)

"""cap_and_spill: pass 1 at capacity C, pass 2 at S, an exact fallback beyond.

Both passes always run with fixed shapes. Streams longer than C + S (rare
when C and S come from calibration) are finished by a third pass under
`lax.cond`; its predicate comes from the (source, destination) counts every
rank all-gathered, so every rank takes the same branch and the collectives
inside stay matched. On GPU, XLA reads that predicate on the host
(docs/design/cap_and_spill_fallback.md).

The combine runs once, after every pass: inside the fallback branch over
both returned windows (positions [0, C + S) and [C + S, worst)), in the
other branch over the first alone. A token's picks are thus summed in pick
order in one float32 accumulation, whichever pass moved each of them, so the
output has `dense`'s bits at any top-k (adding the fallback's partial sum to
pass 1's would round a token's sum in another order). The backward does the
same for the tokens' gradient: both windows' packs send their row gradients
to one tap (passes.tap_tokens), summed per token in pick order once.

With expert functions whose weight gradients are summed per (expert,
source) (`takes_sources`: the layer's experts with the row-invariant
matmul), the fallback moves every stream position [0, worst) again instead
of the rest alone, and the combine reads only that: each (expert, source)'s
rows then reach its experts in one call, so their weight-gradient partial
is one sum over them, as on every other strategy (the first exchange's
outputs, unread, add exact zeros).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax.dispatch.context import DispatchContext
from moe_jax.dispatch.passes import (combine_windows, exchange_window, merge_delivered,
                                     tap_tokens)
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
    residual = worst - cap - spill
    tap = None
    if residual > 0 and not _measure_without_fallback:
        x, tap = tap_tokens(x, plan.top_k)   # one pick-order sum of both windows' gradients
    returned, delivered = exchange_window(x, plan, recv_expert_counts, ctx, expert_fn,
                                          start=0, capacity=cap, spill_capacity=spill,
                                          delivered_rows=delivered_rows, tap=tap)
    stats = stream_stats(peer_counts, cap, spill, num_slots=plan.num_slots * ctx.num_ranks)
    if residual == 0 or _measure_without_fallback:
        return combine_windows(returned, None, weights, plan, ctx, start=0), stats, delivered

    chain = ctx.chain_state()
    # The NCCL custom call does not run inside a captured conditional (XLA
    # records a command at most once); the rare fallback uses XLA's own.
    fallback_ctx = ctx if ctx.platform == "cpu" else dataclasses.replace(ctx, transport="lax")

    whole_streams = getattr(expert_fn, "takes_sources", False)

    def fallback(_):
        ctx.restore_chain(chain)
        if whole_streams:
            every, every_delivered = exchange_window(
                x, plan, recv_expert_counts, fallback_ctx, expert_fn, start=0, capacity=worst,
                delivered_rows=delivered_rows, tap=tap)
            return combine_windows(every, None, weights, plan, ctx, start=0), every_delivered
        more, more_delivered = exchange_window(
            x, plan, recv_expert_counts, fallback_ctx, expert_fn, start=cap + spill,
            capacity=residual, delivered_rows=delivered_rows, tap=tap)
        out = combine_windows(returned, more, weights, plan, ctx, start=0)
        return out, more_delivered

    def skip(_):
        out = combine_windows(returned, None, weights, plan, ctx, start=0)
        if delivered_rows is None:
            return out, None
        return out, jax.tree.map(jnp.zeros_like, delivered)

    out, extra_delivered = jax.lax.cond(stats.fallback_steps > 0, fallback, skip, None)
    ctx.restore_chain(chain)
    out = ctx.chain_after(out)
    return out, stats, merge_delivered(delivered, extra_delivered)

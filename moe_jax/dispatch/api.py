"""`dispatch_combine`: route rows to experts and back with a chosen strategy."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.dispatch.cap_and_spill import cap_and_spill
from moe_jax.dispatch.context import DispatchContext
from moe_jax.dispatch.dense import dense
from moe_jax.dispatch.max_counts import max_counts
from moe_jax.dispatch.nvlink_path import nvlink_dispatch_combine
from moe_jax.dispatch.passes import Delivered, ExpertFn
from moe_jax.dispatch.ragged import ragged
from moe_jax.dispatch.stats import DispatchStats
from moe_jax.plan import make_plan, worst_case_rows_per_peer

STRATEGIES = {"dense": dense, "max_counts": max_counts, "cap_and_spill": cap_and_spill,
              "ragged": ragged}


class DispatchResult(NamedTuple):
    """out: [T, H] in the dtype of x; stats: DispatchStats; delivered: the
    rows this rank's experts received (only with return_delivered=True)."""

    out: jax.Array
    stats: DispatchStats
    delivered: Delivered | None


def exchange_counts(plan, ctx: DispatchContext):
    """One all-gather of every rank's [P, E_local] send counts.

    Returns (recv_expert_counts [P, E_local]: rows each source sends this
    rank's experts, peer_counts [P, P]: rows from each source to each
    destination, the same on every rank). The stats and the fallback's
    predicate come from peer_counts, so they need no other collective.
    """
    everyone = ctx.all_gather(plan.send_expert_counts)          # [P(src), P(dst), E_local]
    recv = jax.lax.dynamic_index_in_dim(everyone, ctx.rank(), axis=1, keepdims=False)
    return recv, jnp.sum(everyone, axis=2)


def _check(cond, argument, message):
    if not cond:
        raise ValueError(f"dispatch_combine: argument '{argument}' {message}")


def dispatch_combine(x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                     expert_fn: ExpertFn, *, strategy: str, ctx: DispatchContext,
                     experts_per_rank: int, capacity: int | None = None,
                     spill_capacity: int | None = None,
                     return_delivered: bool = False) -> DispatchResult:
    """Sends every (token, pick) row to its expert and merges the results.

    Inside `jax.shard_map` over `ctx.axis_name` (except for "dense", which
    runs on one rank). Static shapes; no host synchronization.

    Args:
      x: [T, H] this rank's tokens (float32, bfloat16 or float16).
      expert_ids: [T, k] integer global expert ids, distinct per token, in
        [0, P * experts_per_rank). A pick that breaks this (an id out of
        range, negative, or repeating an earlier pick of its token) is
        dropped on every strategy and transport alike: it moves nowhere,
        adds nothing to its token's output (nor any gradient) and is
        counted in stats.dropped_rows.
      weights: [T, k] float32 combine weights.
      expert_fn: applies this rank's experts to rows grouped by local expert
        (moe_jax.dispatch.passes.ExpertFn; one whose `takes_sources` is true
        is also told each expert's rows per source rank).
      strategy: "dense", "max_counts", "cap_and_spill" or "ragged".
      ctx: rank group, transport and kernel implementation.
      experts_per_rank: E_local.
      capacity, spill_capacity: C and S for "cap_and_spill".
      return_delivered: also return the rows each expert received.
    Returns:
      DispatchResult; out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]).
    """
    _check(strategy in STRATEGIES, "strategy", f"must be one of {tuple(STRATEGIES)}, "
           f"got {strategy!r}")
    _check(x.ndim == 2, "x", f"must be [T, H], got shape {list(x.shape)}")
    _check(expert_ids.ndim == 2 and expert_ids.shape[0] == x.shape[0]
           and jnp.issubdtype(expert_ids.dtype, jnp.integer), "expert_ids",
           f"must be integer [T={x.shape[0]}, k], got {expert_ids.dtype}{list(expert_ids.shape)}")
    _check(weights.shape == expert_ids.shape and weights.dtype == jnp.float32, "weights",
           f"must be float32 {list(expert_ids.shape)}, got {weights.dtype}{list(weights.shape)}")
    _check(experts_per_rank >= 1, "experts_per_rank", f"must be >= 1, got {experts_per_rank}")
    if strategy == "dense":
        _check(ctx.num_ranks == 1, "ctx", "must have one rank for strategy 'dense'")
    if strategy == "cap_and_spill":
        _check(capacity is not None and capacity >= 1, "capacity",
               f"must be an integer >= 1 for cap_and_spill, got {capacity!r}")
        _check(spill_capacity is not None and spill_capacity >= 0, "spill_capacity",
               f"must be an integer >= 0 for cap_and_spill, got {spill_capacity!r}")
    _check(ctx.transport in ("lax", "custom_call", "nvlink", "fast"), "ctx",
           f"transport must be 'lax', 'custom_call', 'nvlink' or 'fast' (resolve 'auto' "
           f"with moe_jax.resolve_transport), got {ctx.transport!r}")
    if ctx.transport == "fast" and strategy != "dense" and ctx.num_ranks > 1:
        _check(strategy == "ragged", "strategy",
               f"must be 'ragged' with transport 'fast' (FAST moves only the real rows "
               f"into buffers sized for the worst case, which is what 'ragged' sends), got "
               f"{strategy!r}")
        topology = ctx.fast_topology
        _check(topology is not None and getattr(topology, "num_gpus", None) == ctx.num_ranks,
               "ctx", f"must carry a fast_topology of num_ranks={ctx.num_ranks} GPUs for "
               f"transport 'fast', got {topology}")
    if strategy == "ragged" and ctx.transport == "custom_call" and ctx.platform == "gpu" \
            and ctx.num_ranks > 1:
        _check(False, "ctx", "transport 'custom_call' has no ragged exchange on GPUs (NCCL "
               "would need the row counts on the host): use 'lax' "
               "(lax.ragged_all_to_all), 'nvlink' or 'auto' for strategy 'ragged'")
    if ctx.transport == "nvlink" and strategy != "dense" and ctx.num_ranks > 1:
        _check(strategy in ("ragged", "cap_and_spill"), "strategy",
               f"must be 'ragged' or 'cap_and_spill' with transport 'nvlink', got {strategy!r}")
        _check(ctx.platform == "gpu", "ctx", "must target GPUs for transport 'nvlink'")
        _check(ctx.mesh_devices is not None, "ctx",
               "must carry mesh_devices (the mesh's devices) for transport 'nvlink'")
        out, stats, delivered = nvlink_dispatch_combine(
            x, expert_ids, weights, expert_fn, strategy=strategy, ctx=ctx,
            experts_per_rank=experts_per_rank, capacity=capacity,
            spill_capacity=spill_capacity, return_delivered=return_delivered)
        return DispatchResult(out.astype(x.dtype), stats, delivered)
    ctx.start_chain()
    plan = make_plan(expert_ids.astype(jnp.int32), ctx.num_ranks, experts_per_rank)
    recv_expert_counts, peer_counts = exchange_counts(plan, ctx)
    delivered_rows = None
    if return_delivered:
        delivered_rows = ctx.num_ranks * worst_case_rows_per_peer(
            x.shape[0], plan.top_k, experts_per_rank)
    out, stats, delivered = STRATEGIES[strategy](
        x, weights, plan, ctx, expert_fn, recv_expert_counts=recv_expert_counts,
        capacity=capacity, spill_capacity=spill_capacity, peer_counts=peer_counts,
        delivered_rows=delivered_rows)
    return DispatchResult(out.astype(x.dtype), stats, delivered)

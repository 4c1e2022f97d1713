"""The building block every strategy shares: one exchange of stream windows.

A pass moves stream positions [start, start + capacity + spill) of every
(source -> destination) stream: pack, all-to-all, experts on the received
rows, all-to-all back, combine. Strategies differ only in which passes they
run and how buffers cross ranks.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from moe_jax import manual_axes
from moe_jax.dispatch.context import DispatchContext
from moe_jax.ordered_grads import SourceSizes
from moe_jax.plan import DispatchPlan, exclusive_cumsum
from moe_jax.rounding import as_float32

ExpertFn = Callable[[jax.Array, jax.Array], jax.Array]
"""(rows [M, H] sorted by local expert, group_sizes [E_local] int32) -> [M, H].

Rows past sum(group_sizes) are padding and may hold any bits (a transport's
receive buffer, NaN included): an expert function gives them zero outputs
and lets them touch neither the real rows' outputs nor any gradient (the
grouped matmuls of moe_jax.ops.grouped_matmul never read them).

An expert function whose attribute `takes_sources` is true is also given
`sources=` a moe_jax.ordered_grads.SourceSizes: the rows of each local
expert per source rank (the layer's experts use it for weight gradients
summed in source order)."""


def call_experts(expert_fn: ExpertFn, rows: jax.Array, group_sizes: jax.Array,
                 sources: SourceSizes | None) -> jax.Array:
    """expert_fn on rows, given the sources where it takes them."""
    if sources is not None and getattr(expert_fn, "takes_sources", False):
        return expert_fn(rows, group_sizes, sources=sources)
    return expert_fn(rows, group_sizes)


class Delivered(NamedTuple):
    """Rows a rank's experts received, in canonical order (a test/debug view).

    rows: [R, H] expert-major; within an expert by (source rank, token, pick).
    valid: [R] bool, True for rows that were delivered.
    group_sizes: [E_local] int32 rows per local expert.
    """

    rows: jax.Array
    valid: jax.Array
    group_sizes: jax.Array


def merge_delivered(a: Delivered | None, b: Delivered | None) -> Delivered | None:
    if a is None or b is None:
        return a if b is None else b
    rows = jnp.where(b.valid[:, None], b.rows, a.rows)
    return Delivered(rows, a.valid | b.valid, a.group_sizes)


def locate_rows(src: jax.Array, q: jax.Array, recv_expert_counts: jax.Array):
    """Local expert and canonical index of received rows.

    Args:
      src: [M] int32 source rank of each row.
      q: [M] int32 position of the row in its source's stream.
      recv_expert_counts: [P, E_local] rows each source sends each local expert.
    Returns:
      (local_expert [M], canonical [M]); both are out of range (E_local and
      P * max rows) for rows past the end of their stream.
    """
    num_ranks, num_local = recv_expert_counts.shape
    ends = jnp.cumsum(recv_expert_counts, axis=1)
    valid = q < ends[src, -1]
    local = jnp.sum(q[:, None] >= ends[src], axis=1).astype(jnp.int32)
    local = jnp.where(valid, local, num_local)
    safe = jnp.minimum(local, num_local - 1)
    expert_offset = exclusive_cumsum(jnp.sum(recv_expert_counts, axis=0))
    src_offset = exclusive_cumsum(recv_expert_counts, axis=0)
    stream_start = ends - recv_expert_counts
    canonical = (expert_offset[safe] + src_offset[src, safe] + q - stream_start[src, safe])
    invalid_index = jnp.iinfo(jnp.int32).max
    return local, jnp.where(valid, canonical, invalid_index).astype(jnp.int32)


def window_positions(src: jax.Array, q: jax.Array, recv_expert_counts: jax.Array, *,
                     start: int, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where received rows go when a window's rows are sorted by local expert.

    Args:
      src, q: [M] int32 source rank and stream position of each received row,
        every q in [start, start + width).
      recv_expert_counts: [P, E_local] rows each source sends each local expert
        (its stream: expert-major, so expert e's rows are one range of it).
      start, width: the window of stream positions the rows come from.
    Returns:
      (pos [M] int32: the row's index in the window's rows ordered by local
       expert, then source, then stream position (a stable sort by expert of
       the source-major rows); M + (the row's index) for rows past their
       stream's end, so every index is distinct,
       group_sizes [E_local] int32: the window's rows per local expert,
       in_window [P, E_local] int32: the window's rows per (source, local
       expert)).
    """
    num_local = recv_expert_counts.shape[1]
    ends = jnp.cumsum(recv_expert_counts, axis=1)
    lo = jnp.clip(ends - recv_expert_counts, start, start + width)
    in_window = (jnp.clip(ends, start, start + width) - lo).astype(jnp.int32)
    group_sizes = jnp.sum(in_window, axis=0).astype(jnp.int32)
    local = jnp.sum(q[:, None] >= ends[src], axis=1)
    safe = jnp.minimum(local, num_local - 1)
    pos = (exclusive_cumsum(group_sizes)[safe] + exclusive_cumsum(in_window, axis=0)[src, safe]
           + q - lo[src, safe])
    beyond = q.shape[0] + jnp.arange(q.shape[0])
    return jnp.where(local < num_local, pos, beyond).astype(jnp.int32), group_sizes, in_window


def run_experts(rows: jax.Array, pos: jax.Array, group_sizes: jax.Array, expert_fn: ExpertFn,
                *, in_order: bool = False, sources: SourceSizes | None = None) -> jax.Array:
    """Applies each row's expert (window_positions gives pos and group_sizes).

    rows: [M, H] received rows; pos: [M] their expert-major positions (>= M
    for padding rows, whose outputs are zero). With in_order (one source: its
    window is already expert-major, pos is the identity on real rows and
    padding comes last) the rows go to the experts as they are. sources:
    passed on to expert functions that take them (call_experts).
    """
    if in_order:
        return call_experts(expert_fn, rows, group_sizes, sources)
    ordered = jnp.zeros_like(rows).at[pos].set(rows, mode="drop", unique_indices=True)
    return call_experts(expert_fn, ordered, group_sizes, sources).at[pos].get(
        mode="fill", fill_value=0, unique_indices=True)


def deliver(rows, canonical, recv_expert_counts, total_rows: int) -> Delivered:
    """Scatters received rows to their canonical slots (for tests and debugging)."""
    buf = jnp.zeros((total_rows,) + rows.shape[1:], rows.dtype)
    buf = buf.at[canonical].set(rows, mode="drop")
    valid = jnp.zeros((total_rows,), bool).at[canonical].set(True, mode="drop")
    return Delivered(buf, valid, jnp.sum(recv_expert_counts, axis=0).astype(jnp.int32))


def tap_tokens(x: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """(x, tap): x unchanged, and a [T * k, H] float32 zero array whose
    cotangent collects every pick's row gradient at its slot t * k + j.

    Packs that take the tap (`send_window(..., tap=tap)`) give x no gradient
    of their own: each writes its window's row gradients into the tap's
    (each slot travels in exactly one window, so the windows' tap cotangents
    add exactly), and x's gradient is then the float32 sum of a token's picks
    in pick order, rounded once: the transpose `pack` has in one window,
    over every window together. So a strategy with several windows (the
    cap-and-spill fallback) has dense's token gradient bits. The tap is
    never read in the forward (XLA removes it); its cotangent costs one
    [T * k, H] float32 buffer per window in the backward.
    """

    def primal(x):
        tap = jnp.zeros((x.shape[0] * top_k,) + x.shape[1:], jnp.float32)
        return x, manual_axes.as_varying(tap, manual_axes.varying_axes(x))

    run = jax.custom_vjp(primal)

    def fwd(x):
        return primal(x), None

    def bwd(_, cotangents):
        g_x, g_tap = cotangents
        picks = g_tap.reshape((g_tap.shape[0] // top_k, top_k) + g_tap.shape[1:])
        acc = jnp.zeros(picks.shape[:1] + picks.shape[2:], jnp.float32)
        for j in range(top_k):    # pick order, as pack's transpose sums
            acc = acc + picks[:, j]
        return ((acc + as_float32(g_x)).astype(g_x.dtype),)

    run.defvjp(fwd, bwd)
    return run(x)


def _tapped_pack(x, tap, plan: DispatchPlan, ctx: DispatchContext, *, start: int,
                 width: int) -> jax.Array:
    """ctx.pack of window [start, start + width) whose gradient goes to the
    tap's slots (tap_tokens) instead of x."""

    x_shape, x_dtype, x_axes = x.shape, x.dtype, manual_axes.varying_axes(x)

    def primal(x, tap, sorted_slots, send_offsets, send_counts):
        buf, _ = ctx.pack(x, sorted_slots, send_offsets, send_counts, top_k=plan.top_k,
                          start=start, capacity=width, spill_capacity=0)
        return buf

    run = jax.custom_vjp(primal)

    def fwd(x, tap, sorted_slots, send_offsets, send_counts):
        return (primal(x, tap, sorted_slots, send_offsets, send_counts),
                (sorted_slots, send_offsets, send_counts))

    def bwd(residuals, g_buf):
        sorted_slots, send_offsets, send_counts = residuals
        zero_x = manual_axes.as_varying(jnp.zeros(x_shape, x_dtype), x_axes)
        position = start + jnp.arange(width, dtype=jnp.int32)
        in_stream = position[None, :] < send_counts[:, None]
        index = jnp.minimum(send_offsets[:, None] + position[None, :], sorted_slots.shape[0] - 1)
        slot = jnp.where(in_stream, sorted_slots[index], sorted_slots.shape[0])
        g_tap = jnp.zeros((sorted_slots.shape[0],) + g_buf.shape[2:], jnp.float32)
        g_tap = g_tap.at[slot.reshape(-1)].set(
            as_float32(g_buf.reshape((-1,) + g_buf.shape[2:])), mode="drop")
        return zero_x, manual_axes.as_varying(g_tap, manual_axes.varying_axes(g_buf)), \
            None, None, None

    run.defvjp(fwd, bwd)
    return run(x, tap, plan.sorted_slots, plan.send_offsets, plan.send_counts)


def send_window(x: jax.Array, plan: DispatchPlan, ctx: DispatchContext, *, start: int,
                capacity: int, spill_capacity: int = 0, tap: jax.Array | None = None
                ) -> jax.Array:
    """Dispatch half of a pass: pack, then all-to-all.

    Returns [P, capacity + spill_capacity, H]: row (src, c) holds stream
    position start + c of the (src -> this rank) stream, zero past its end.
    With fixed-shape transports a spill window costs the same bytes whether
    it travels beside the capped window or after it, so both are packed into
    one buffer and cross ranks in a single all-to-all (one latency, no
    concatenation or split).
    """
    width = capacity + spill_capacity
    if tap is not None:
        return ctx.all_to_all(_tapped_pack(x, tap, plan, ctx, start=start, width=width))
    buf, _ = ctx.pack(x, plan.sorted_slots, plan.send_offsets, plan.send_counts,
                      top_k=plan.top_k, start=start, capacity=width, spill_capacity=0)
    return ctx.all_to_all(buf)


def return_window(out_rows: jax.Array, weights: jax.Array, plan: DispatchPlan,
                  ctx: DispatchContext, *, start: int) -> jax.Array:
    """Combine half of a pass: all-to-all back, then the weighted merge.

    out_rows: [P, W, H] expert outputs in the layout send_window delivered.
    Returns the partial output [T, H] float32 of the picks in this pass.
    """
    return combine_windows(ctx.all_to_all(out_rows), None, weights, plan, ctx, start=start)


def combine_windows(returned: jax.Array, more: jax.Array | None, weights: jax.Array,
                    plan: DispatchPlan, ctx: DispatchContext, *, start: int) -> jax.Array:
    """The weighted merge of one or two returned windows, in one call.

    returned: [P, W, H] expert outputs of stream positions [start, start + W)
      back at their source; more: [P, W2, H] those of the next W2 positions
      (None for none).
    Returns [T, H] float32: every token's picks inside the windows summed in
    pick order (float32, multiply and add rounded separately), the others
    adding nothing. One call over all windows keeps the order of a token's
    sum that of `dense`, whichever windows its picks travelled in.
    """
    if more is None:
        more = jnp.zeros((returned.shape[0], 0) + returned.shape[2:], returned.dtype)
    return ctx.combine(returned, more, plan.dest, plan.pos, weights, start=start,
                       out_dtype=jnp.float32)


def exchange_window(x: jax.Array, plan: DispatchPlan, recv_expert_counts: jax.Array,
                    ctx: DispatchContext, expert_fn: ExpertFn, *, start: int, capacity: int,
                    spill_capacity: int = 0, delivered_rows: int | None = None,
                    tap: jax.Array | None = None):
    """Moves stream positions [start, start + W), W = capacity + spill_capacity,
    to the experts and their outputs back, without combining them.

    Args:
      x: [T, H] tokens.
      recv_expert_counts: [P, E_local] int32 rows each source sends to each
        of this rank's experts (from the counts exchange).
      delivered_rows: if given, also return a Delivered view of that size.
      tap: from tap_tokens(x, k), for strategies of several windows.
    Returns:
      (returned [P, W, H] in x's dtype: row (p, c) is the expert output of
       this rank's stream position start + c to rank p, zero past the
       stream's end; Delivered or None).
    """
    num_ranks = plan.num_ranks
    rows = send_window(x, plan, ctx, start=start, capacity=capacity,
                       spill_capacity=spill_capacity, tap=tap)
    width = capacity + spill_capacity
    src = jnp.repeat(jnp.arange(num_ranks, dtype=jnp.int32), width)
    q = jnp.tile(start + jnp.arange(width, dtype=jnp.int32), num_ranks)
    pos, group_sizes, in_window = window_positions(src, q, recv_expert_counts, start=start,
                                                   width=width)
    flat = rows.reshape((num_ranks * width,) + rows.shape[2:])
    sources = SourceSizes(in_window.T, min(width, x.shape[0]))
    out_rows = run_experts(flat, pos, group_sizes, expert_fn, in_order=num_ranks == 1,
                           sources=sources).reshape(rows.shape)
    delivered = None
    if delivered_rows is not None:
        _, canonical = locate_rows(src, q, recv_expert_counts)
        delivered = deliver(flat, canonical, recv_expert_counts, delivered_rows)
    return ctx.all_to_all(out_rows), delivered


def window_pass(x: jax.Array, weights: jax.Array, plan: DispatchPlan,
                recv_expert_counts: jax.Array, ctx: DispatchContext, expert_fn: ExpertFn, *,
                start: int, capacity: int, spill_capacity: int = 0,
                delivered_rows: int | None = None):
    """One exchange of stream positions [start, start + capacity + spill_capacity),
    combined.

    Args: as exchange_window; weights: [T, k] float32 combine weights.
    Returns:
      (partial output [T, H] float32 holding the picks this pass moved,
       Delivered or None).
    """
    returned, delivered = exchange_window(x, plan, recv_expert_counts, ctx, expert_fn,
                                          start=start, capacity=capacity,
                                          spill_capacity=spill_capacity,
                                          delivered_rows=delivered_rows)
    return combine_windows(returned, None, weights, plan, ctx, start=start), delivered

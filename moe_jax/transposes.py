"""Index maps behind the VJPs of pack and combine (pure JAX, static shapes).

pack and combine are each other's transposes: pack copies slot rows into
stream windows, combine sums window rows back into slot order. Their VJPs
(moe_jax/custom_calls.py) need each call's map in the other direction:

* `stream_positions`: pack's operands (stream-ordered slots, stream starts
  and lengths) as combine's (destination and stream position per slot);
* `combine_cotangents`: combine's cotangents, the window rows' (each the
  pick's weight times the output gradient of its token, gathered into the
  window layout) and the weights' (per pick, the dot of its token's output
  gradient with the row the pick read, summed in a fixed order by
  `row_dots`).

Both follow the plan's layout (moe_jax/plan.py): streams are disjoint, and a
(destination, position) pair names at most one slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.plan import DROPPED_POS
from moe_jax.rounding import as_float32


def row_dots(a: jax.Array, b: jax.Array) -> jax.Array:
    """[N] float32 dots of the rows of a and b ([N, H] float32).

    Products rounded to float32 (never fused into an FMA), then summed by a
    fixed pairwise tree over the columns (halves added elementwise, odd
    widths padded with +0), so a row's bits depend on that row alone, not on
    N or on how XLA would tile a reduction. The gradients of the combine
    weights use it, so every strategy gets the same bits.
    """
    acc = jax.lax.optimization_barrier(a * b)
    while acc.shape[-1] > 1:
        width = acc.shape[-1]
        if width % 2:
            acc = jnp.concatenate([acc, jnp.zeros(acc.shape[:-1] + (1,), acc.dtype)], axis=-1)
            width += 1
        acc = acc[..., :width // 2] + acc[..., width // 2:]
    return acc[..., 0] if acc.shape[-1] else jnp.zeros(acc.shape[:-1], acc.dtype)


def stream_positions(sorted_slots: jax.Array, send_offsets: jax.Array,
                     send_counts: jax.Array):
    """Where pack reads each slot.

    Args:
      sorted_slots: [N] int32, a permutation of the slots in stream order.
      send_offsets, send_counts: [P] int32 start and length of each stream in
        sorted_slots (disjoint ranges).
    Returns:
      (dest [N] int32, pos [N] int32): the stream and the position in it of
      every slot; slots in no stream get dest 0 and pos DROPPED_POS (past
      every window).
    """
    num_slots = sorted_slots.shape[0]
    order = jnp.zeros((num_slots,), jnp.int32).at[sorted_slots].set(
        jnp.arange(num_slots, dtype=jnp.int32), mode="drop")
    inside = ((order[:, None] >= send_offsets[None, :])
              & (order[:, None] < send_offsets[None, :] + send_counts[None, :]))
    dest = jnp.argmax(inside, axis=1).astype(jnp.int32)
    found = jnp.any(inside, axis=1)
    pos = jnp.where(found, order - send_offsets[dest], DROPPED_POS).astype(jnp.int32)
    return jnp.where(found, dest, 0), pos


def _window_slot(dest, q, present, num_ranks: int, width: int) -> jax.Array:
    """[num_ranks * width] int32: the slot read at each row of a window
    (rows indexed dest * width + q), -1 where no slot is."""
    num_slots = dest.shape[0]
    index = jnp.where(present, dest * width + q, num_ranks * width)
    return jnp.full((num_ranks * width,), -1, jnp.int32).at[index].set(
        jnp.arange(num_slots, dtype=jnp.int32), mode="drop")


def _window_cotangent(ret, dest, q, present, weights_flat, g32, top_k):
    """Cotangent of one returned window [P, W, H]: weight x output gradient."""
    num_ranks, width = ret.shape[0], ret.shape[1]
    if width == 0:
        return jnp.zeros_like(ret)
    slot = _window_slot(dest, q, present, num_ranks, width)
    has = slot >= 0
    safe = jnp.maximum(slot, 0)
    rows = weights_flat[safe][:, None] * g32[safe // top_k]
    rows = jnp.where(has[:, None], rows, jnp.float32(0))
    return rows.astype(ret.dtype).reshape(ret.shape)


def combine_cotangents(g: jax.Array, cap_ret: jax.Array, spill_ret: jax.Array,
                       dest: jax.Array, pos: jax.Array, weights: jax.Array, *, start: int):
    """The VJP of `moe_jax_combine` (see custom_calls.combine).

    Args:
      g: [T, H] cotangent of the output (any float dtype).
      cap_ret [P, C, H], spill_ret [P, S, H], dest [N], pos [N], weights [T, k]:
        the forward's operands; start: its attribute.
    Returns:
      (d_cap [P, C, H] and d_spill [P, S, H] in cap_ret's dtype: row of slot
       (t, j) = f32(weights[t, j] * f32(g[t])) rounded to that dtype, zero for
       rows no slot reads; d_weights [T, k] float32: row_dots of f32(g[t])
       and f32(row of (t, j)), 0 for picks outside the windows).
    """
    num_tokens, top_k = weights.shape
    capacity, spill = cap_ret.shape[1], spill_ret.shape[1]
    g32 = as_float32(g)
    weights_flat = weights.reshape(-1).astype(jnp.float32)
    q = pos - start
    in_cap = (q >= 0) & (q < capacity)
    in_spill = (q >= capacity) & (q < capacity + spill)
    d_cap = _window_cotangent(cap_ret, dest, q, in_cap, weights_flat, g32, top_k)
    d_spill = _window_cotangent(spill_ret, dest, q - capacity, in_spill, weights_flat, g32,
                                top_k)
    hidden = cap_ret.shape[2:]
    rows = jnp.zeros((dest.shape[0],) + hidden, jnp.float32)
    if capacity:
        rows = jnp.where(in_cap[:, None],
                         as_float32(cap_ret[dest, jnp.clip(q, 0, capacity - 1)]), rows)
    if spill:
        rows = jnp.where(in_spill[:, None],
                         as_float32(spill_ret[dest, jnp.clip(q - capacity, 0, spill - 1)]), rows)
    dots = row_dots(jnp.repeat(g32, top_k, axis=0), rows)
    d_weights = jnp.where(in_cap | in_spill, dots, jnp.float32(0)).reshape(num_tokens, top_k)
    return d_cap, d_spill, d_weights

"""Pure-JAX references of the custom calls (docs/design/custom_calls.md).

Each function computes exactly what its custom call computes, bit for bit;
the tests hold the custom calls to them, and `kernel_impl="reference"` runs
them in place of the custom calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _window_rows(x, sorted_slots, send_offsets, send_counts, top_k, first, size):
    """Rows at stream positions [first, first + size) of every destination."""
    num_ranks = send_counts.shape[0]
    num_slots = sorted_slots.shape[0]
    if size == 0:
        return jnp.zeros((num_ranks, 0) + x.shape[1:], x.dtype)
    q = first + jnp.arange(size, dtype=jnp.int32)
    valid = q[None, :] < send_counts[:, None]
    index = jnp.clip(send_offsets[:, None] + q[None, :], 0, num_slots - 1)
    rows = x[sorted_slots[index] // top_k]
    return jnp.where(valid[..., None], rows, jnp.zeros((), x.dtype))


def pack(x, sorted_slots, send_offsets, send_counts, *, top_k, start, capacity,
         spill_capacity):
    """Reference of `moe_jax_pack`: ([P, capacity, H], [P, spill_capacity, H])."""
    cap = _window_rows(x, sorted_slots, send_offsets, send_counts, top_k, start, capacity)
    spill = _window_rows(x, sorted_slots, send_offsets, send_counts, top_k,
                         start + capacity, spill_capacity)
    return cap, spill


def combine(cap_ret, spill_ret, dest, pos, weights, *, start, out_dtype):
    """Reference of `moe_jax_combine`: [T, H] in `out_dtype`.

    Float32 accumulation over the k picks in order, multiply and add rounded
    separately; picks outside both windows add +0.0.
    """
    num_tokens, top_k = weights.shape
    capacity, spill = cap_ret.shape[1], spill_ret.shape[1]
    hidden = cap_ret.shape[2:]
    q = pos - start
    in_cap = (q >= 0) & (q < capacity)
    in_spill = (q >= capacity) & (q < capacity + spill)
    y = jnp.zeros((dest.shape[0],) + hidden, jnp.float32)
    if capacity:
        y = jnp.where(in_cap[:, None], cap_ret[dest, jnp.clip(q, 0, capacity - 1)]
                      .astype(jnp.float32), y)
    if spill:
        y = jnp.where(in_spill[:, None], spill_ret[dest, jnp.clip(q - capacity, 0, spill - 1)]
                      .astype(jnp.float32), y)
    y = y.reshape((num_tokens, top_k) + hidden)
    present = (in_cap | in_spill).reshape(num_tokens, top_k)
    weights = weights.astype(jnp.float32)
    acc = jnp.zeros((num_tokens,) + hidden, jnp.float32)
    for j in range(top_k):
        term = jnp.where(present[:, j, None], weights[:, j, None] * y[:, j], jnp.float32(0))
        # The barrier keeps XLA from contracting multiply and add into an FMA.
        acc = acc + jax.lax.optimization_barrier(term)
    return acc.astype(out_dtype)


def ragged_all_to_all(send, send_offsets, send_sizes, recv_offsets, recv_rows, *, axis_name):
    """Reference of `moe_jax_all_to_all`, built from all_gather (inside shard_map).

    Returns (recv [recv_rows, ...], recv_sizes [P]).
    """
    rank = jax.lax.axis_index(axis_name)
    all_send = jax.lax.all_gather(send, axis_name)
    sizes_from = jax.lax.all_gather(send_sizes, axis_name)[:, rank]
    offsets_from = jax.lax.all_gather(send_offsets, axis_name)[:, rank]
    r = jnp.arange(recv_rows, dtype=jnp.int32)
    inside = (r[None, :] >= recv_offsets[:, None]) & (
        r[None, :] < recv_offsets[:, None] + sizes_from[:, None])
    src = jnp.argmax(inside, axis=0)
    row = jnp.clip(offsets_from[src] + r - recv_offsets[src], 0, send.shape[0] - 1)
    rows = all_send[src, row]
    mask = jnp.any(inside, axis=0).reshape((recv_rows,) + (1,) * (send.ndim - 1))
    return jnp.where(mask, rows, jnp.zeros((), send.dtype)), sizes_from

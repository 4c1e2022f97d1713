"""Gradients of the count-aware dispatch and combine (the NVLink transport).

The backward runs the same two operations in the other direction:

* dispatch (tokens -> rows grouped by expert): its transpose is a combine
  of the rows' gradients with unit weights, which sums each token's picks
  in float32 in pick order (as pack's transpose does on the other paths).
* combine (rows -> weighted sum per token): the rows' gradient is
  weight x output gradient, delivered where the rows were. A dispatch of
  the output gradient brings g[t] to every row of token t; a dispatch of a
  small float32 side row per token (its k weights and k expert ids) lets
  the receiving rank find which pick each row is (the one whose id is the
  row's expert: picks of a token are distinct) and scale it. The weights'
  gradient is a per-pick dot of g[t] with the row, computed where the row
  is and sent home by a combine of one-hot rows (unit weights: the sum of
  a token's one-hot rows puts pick j's dot in column j, exactly).

Written against `CountAwareOps`, two operations on channels of any row
width and dtype: `moe_jax.nvlink.ChannelOps` (the CUDA kernels) and
`moe_jax.nvlink_reference.ReferenceOps` (pure JAX, any backend), so the
rules are tested on CPU with the reference and on GPUs with the kernels.
Every backward call has the forward's static shapes; none reads the host,
so the backward is graph-capturable where the kernels are.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from moe_jax.fp8 import dequantize
from moe_jax.rounding import as_float32
from moe_jax.transposes import row_dots


class CountAwareOps(Protocol):
    """The fused count-aware calls of one expert group (one channel per row
    width, dtype and dispatch format)."""

    axis_name: str
    experts_per_rank: int

    def dispatch(self, x: jax.Array, expert_ids: jax.Array, *, fp8: bool = False) -> Any:
        """x [T, W] -> a moe_jax.nvlink.Dispatched of rows [P * T * min(k,
        E_local), W]: float8_e4m3fn rows and scales with fp8, else x's dtype."""

    def combine(self, y: jax.Array, all_counts: jax.Array, expert_ids: jax.Array,
                slot_pos: jax.Array, weights: jax.Array) -> jax.Array:
        """y [R, W] in the dispatched layout -> [T, W] in y's dtype: per token
        the float32 sum in pick order of weight x row (multiply and add
        rounded separately); picks with slot_pos < 0 add nothing."""


def meta_width(top_k: int) -> int:
    """float32 columns of the side row: k weights, k ids, padded to 16 bytes."""
    return -(-2 * top_k // 4) * 4


def pick_meta(weights: jax.Array, expert_ids: jax.Array) -> jax.Array:
    """[T, meta_width(k)] float32 side rows: the weights, then the ids' bits."""
    num_tokens, top_k = weights.shape
    ids_bits = jax.lax.bitcast_convert_type(expert_ids.astype(jnp.int32), jnp.float32)
    pad = jnp.zeros((num_tokens, meta_width(top_k) - 2 * top_k), jnp.float32)
    return jnp.concatenate([weights.astype(jnp.float32), ids_bits, pad], axis=1)


def received_picks(meta_rows: jax.Array, group_sizes: jax.Array, rank: jax.Array,
                   experts_per_rank: int, top_k: int):
    """Which pick each received row is, from the side rows dispatched with it.

    Args:
      meta_rows: [R, meta_width(k)] float32 side rows in the dispatched layout.
      group_sizes: [E_local] int32 rows per local expert (rows are grouped by
        local expert; rows past their sum are padding).
      rank: int32 scalar, this rank's index in the group.
    Returns:
      (valid [R] bool; pick [R] int32, the index j of the row's pick: the
      one whose id is the row's expert; weight [R] float32, its combine
      weight; pick and weight are 0 on padding rows).
    """
    num_rows = meta_rows.shape[0]
    r = jnp.arange(num_rows, dtype=jnp.int32)
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    local = jnp.sum(r[:, None] >= ends[None, :], axis=1).astype(jnp.int32)
    valid = r < ends[-1]
    expert = rank * experts_per_rank + local
    ids = jax.lax.bitcast_convert_type(meta_rows[:, top_k:2 * top_k], jnp.int32)
    pick = jnp.where(valid, jnp.argmax(ids == expert[:, None], axis=1), 0).astype(jnp.int32)
    weight = jnp.take_along_axis(meta_rows[:, :top_k], pick[:, None], axis=1)[:, 0]
    return valid, pick, jnp.where(valid, weight, jnp.float32(0))


def row_cotangents(g_rows: jax.Array, y: jax.Array, valid: jax.Array, pick: jax.Array,
                   weight: jax.Array, width: int):
    """The combine's cotangents on the rank holding the rows.

    Args:
      g_rows: [R, H] output gradient of each row's token (dispatched).
      y: [R, H] the forward's rows; valid, pick, weight: from received_picks.
      width: columns of the one-hot rows (meta_width(k)).
    Returns:
      (d_y [R, H] in y's dtype: weight * f32(g) on valid rows, else 0;
       one_hot [R, width] float32: the row's dot row_dots(f32(g), f32(y)) in
       column `pick`, zeros elsewhere and on padding rows). The arithmetic
      is that of moe_jax.transposes.combine_cotangents, bit for bit.
    """
    g32 = as_float32(g_rows)
    d_y = jnp.where(valid[:, None], weight[:, None] * g32, jnp.float32(0)).astype(y.dtype)
    dots = jnp.where(valid, row_dots(g32, as_float32(y)), jnp.float32(0))
    columns = jnp.arange(width, dtype=jnp.int32)
    one_hot = jnp.where((columns[None, :] == pick[:, None]) & valid[:, None], dots[:, None],
                        jnp.float32(0))
    return d_y, one_hot


def _unit_weights(expert_ids: jax.Array) -> jax.Array:
    return jnp.ones(expert_ids.shape, jnp.float32)


def _dispatch_rows(ops: CountAwareOps, x, expert_ids, fp8: bool):
    got = ops.dispatch(x, expert_ids, fp8=fp8)
    if fp8:
        # Padding rows hold whatever the receive buffer held, which in e4m3
        # may be NaN; zero them so no expert function sees them.
        rows = jnp.arange(got.rows.shape[0], dtype=jnp.int32) < jnp.sum(got.group_sizes)
        got = got._replace(rows=jnp.where(rows[:, None], dequantize(got.rows, got.scales,
                                                                   x.dtype), 0), scales=None)
    return got


def dispatch(ops: CountAwareOps, x: jax.Array, expert_ids: jax.Array, *, fp8: bool = False):
    """Differentiable dispatch: a Dispatched whose rows are in x's dtype.

    x: [T, H]; expert_ids: [T, k] int32. With fp8 the rows travel as e4m3
    with per-128 scales and come back dequantized to x's dtype (scales
    None) and rows past sum(group_sizes) zero; the gradient passes the
    quantization as the identity (straight-through). The VJP is a combine of the rows' gradients with
    unit weights: dx[t] = the float32 sum of its picks' row gradients in
    pick order, rounded to x's dtype.
    """

    @jax.custom_vjp
    def run(x, expert_ids):
        return _dispatch_rows(ops, x, expert_ids, fp8)

    def fwd(x, expert_ids):
        got = _dispatch_rows(ops, x, expert_ids, fp8)
        return got, (expert_ids, got.all_counts, got.slot_pos)

    def bwd(residuals, cotangent):
        expert_ids, all_counts, slot_pos = residuals
        dx = ops.combine(cotangent.rows, all_counts, expert_ids, slot_pos,
                         _unit_weights(expert_ids))
        return dx.astype(x.dtype), None

    run.defvjp(fwd, bwd)
    return run(x, expert_ids)


def combine(ops: CountAwareOps, y: jax.Array, dispatched: Any, expert_ids: jax.Array,
            weights: jax.Array) -> jax.Array:
    """Differentiable combine: [T, H] in y's dtype.

    y: [R, H] in the dispatched layout; dispatched: the Dispatched it came
    from (all_counts, slot_pos); expert_ids: [T, k] int32 as dispatched;
    weights: [T, k] float32. Differentiable in y and weights (module doc).
    """

    @jax.custom_vjp
    def run(y, weights, expert_ids, all_counts, slot_pos):
        return ops.combine(y, all_counts, expert_ids, slot_pos, weights)

    def fwd(y, weights, expert_ids, all_counts, slot_pos):
        out = ops.combine(y, all_counts, expert_ids, slot_pos, weights)
        return out, (y, weights, expert_ids)

    def bwd(residuals, g):
        y, weights, expert_ids = residuals
        top_k = weights.shape[1]
        g_rows = ops.dispatch(g, expert_ids)
        meta = ops.dispatch(pick_meta(weights, expert_ids), expert_ids)
        rank = jax.lax.axis_index(ops.axis_name).astype(jnp.int32)
        valid, pick, weight = received_picks(meta.rows, meta.group_sizes, rank,
                                             ops.experts_per_rank, top_k)
        d_y, one_hot = row_cotangents(g_rows.rows, y, valid, pick, weight, meta_width(top_k))
        d_weights = ops.combine(one_hot, meta.all_counts, expert_ids, meta.slot_pos,
                                _unit_weights(expert_ids))
        return d_y, d_weights[:, :top_k], None, None, None

    run.defvjp(fwd, bwd)
    return run(y, weights, expert_ids, dispatched.all_counts, dispatched.slot_pos)

"""pack and combine: token rows into per-destination buffers and back.

Semantics: docs/design/custom_calls.md; pure-JAX references: moe_jax/refs.py
(identical bits). Each takes `impl`: "custom_call" (the FFI handler of the
platform) or "reference". Both are differentiable (`jax.custom_vjp`, one
rule for both impls): each is the other's transpose (moe_jax/transposes.py),
and the backward calls are the same custom calls, graph-capturable where
the forward is.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import refs, transposes
from moe_jax.ops.ffi import (FLOAT_DTYPES, call_ffi, check, check_index, require_handlers,
                             same_varying)

PACK = "moe_jax_pack"
COMBINE = "moe_jax_combine"


def pack(x, sorted_slots, send_offsets, send_counts, *, top_k: int, start: int,
         capacity: int, spill_capacity: int, impl: str = "custom_call",
         platform: str | None = None):
    """Gathers token rows into per-destination capped and spill buffers.

    Args:
      x: [T, H] float32/bfloat16/float16 tokens.
      sorted_slots: [T * top_k] int32 slots in stream order (see plan.py).
      send_offsets, send_counts: [P] int32 stream starts and lengths.
      top_k, start, capacity, spill_capacity: static ints.
    Returns:
      cap_buf [P, capacity, H] and spill_buf [P, spill_capacity, H], dtype of
      x: stream positions [start, start+capacity) and the next
      spill_capacity positions; rows past a stream are zero.
    Graph-capturable on CUDA (one kernel launch, no allocation or sync).
    Differentiable in x: the VJP is a combine of the buffers' gradients
    with unit weights (float32 sum of a token's picks in pick order, in x's
    dtype); it assumes the streams are disjoint ranges of a permutation, as
    the plan makes them.
    """
    check(x.ndim == 2 and x.dtype in FLOAT_DTYPES, PACK, "x",
           f"must be a [T, H] float32/bfloat16/float16 array, got {x.dtype}{list(x.shape)}")
    for name, value in (("top_k", top_k),):
        check(value >= 1, PACK, name, f"must be >= 1, got {value}")
    for name, value in (("start", start), ("capacity", capacity),
                        ("spill_capacity", spill_capacity)):
        check(value >= 0, PACK, name, f"must be >= 0, got {value}")
    num_ranks = send_counts.shape[0] if send_counts.ndim == 1 else -1
    check_index(sorted_slots, PACK, "sorted_slots", (x.shape[0] * top_k,))
    check_index(send_offsets, PACK, "send_offsets", (num_ranks,))
    check_index(send_counts, PACK, "send_counts", (num_ranks,))
    attrs = _PackAttrs(int(top_k), int(start), int(capacity), int(spill_capacity), impl,
                       platform)
    if impl != "reference":
        require_handlers(PACK, platform)
    return _pack(attrs, *same_varying(x, sorted_slots, send_offsets, send_counts))


class _PackAttrs(NamedTuple):
    top_k: int
    start: int
    capacity: int
    spill_capacity: int
    impl: str
    platform: str | None


def _pack_call(attrs: _PackAttrs, x, sorted_slots, send_offsets, send_counts):
    kwargs = dict(top_k=attrs.top_k, start=attrs.start, capacity=attrs.capacity,
                  spill_capacity=attrs.spill_capacity)
    if attrs.impl == "reference":
        return refs.pack(x, sorted_slots, send_offsets, send_counts, **kwargs)
    num_ranks, hidden = send_counts.shape[0], x.shape[1]
    out_types = (jax.ShapeDtypeStruct((num_ranks, attrs.capacity, hidden), x.dtype),
                 jax.ShapeDtypeStruct((num_ranks, attrs.spill_capacity, hidden), x.dtype))
    return call_ffi(PACK, out_types, (x, sorted_slots, send_offsets, send_counts),
                     {k: np.int64(v) for k, v in kwargs.items()}, vmap_method="sequential")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pack(attrs, x, sorted_slots, send_offsets, send_counts):
    return _pack_call(attrs, x, sorted_slots, send_offsets, send_counts)


def _pack_fwd(attrs, x, sorted_slots, send_offsets, send_counts):
    out = _pack_call(attrs, x, sorted_slots, send_offsets, send_counts)
    return out, (sorted_slots, send_offsets, send_counts)


def _pack_bwd(attrs, residuals, cotangents):
    """pack's transpose is a combine with unit weights: each token's gradient
    is the float32 sum, in pick order, of its picks' window-row gradients."""
    sorted_slots, send_offsets, send_counts = residuals
    d_cap, d_spill = cotangents
    dest, pos = transposes.stream_positions(sorted_slots, send_offsets, send_counts)
    ones = jnp.ones((sorted_slots.shape[0] // attrs.top_k, attrs.top_k), jnp.float32)
    dx = combine(d_cap, d_spill, dest, pos, ones, start=attrs.start, out_dtype=d_cap.dtype,
                 impl=attrs.impl, platform=attrs.platform)
    return dx, None, None, None


_pack.defvjp(_pack_fwd, _pack_bwd)


def combine(cap_ret, spill_ret, dest, pos, weights, *, start: int, out_dtype,
            impl: str = "custom_call", platform: str | None = None):
    """Weighted merge of returned expert outputs back to token order.

    Args:
      cap_ret: [P, C, H] expert outputs in the layout pack wrote.
      spill_ret: [P, S, H] same dtype (S may be 0).
      dest, pos: [T * k] int32 destination rank and stream position per slot.
      weights: [T, k] float32 combine weights.
      start: stream position of cap_ret[:, 0].
      out_dtype: float32, bfloat16 or float16.
    Returns:
      [T, H] out_dtype; float32 accumulation over the k picks in order; picks
      outside both windows contribute nothing.
    Graph-capturable on CUDA (one kernel launch).
    Differentiable in cap_ret, spill_ret and weights (moe_jax/transposes.py):
    a row's gradient is weights[t, j] * g[t] for the pick (t, j) that read
    it (zero for rows nobody read), a weight's is the float32 dot of g[t]
    with the row its pick read. Assumes no two picks read the same row.
    """
    check(cap_ret.ndim == 3 and cap_ret.dtype in FLOAT_DTYPES, COMBINE, "cap_ret",
           f"must be [P, C, H] float32/bfloat16/float16, got {cap_ret.dtype}{list(cap_ret.shape)}")
    num_ranks, _, hidden = cap_ret.shape
    check(spill_ret.ndim == 3 and spill_ret.dtype == cap_ret.dtype
           and spill_ret.shape[0] == num_ranks and spill_ret.shape[2] == hidden,
           COMBINE, "spill_ret", f"must be [{num_ranks}, S, {hidden}] {cap_ret.dtype}, "
           f"got {spill_ret.dtype}{list(spill_ret.shape)}")
    check(weights.ndim == 2 and weights.dtype == jnp.float32, COMBINE, "weights",
           f"must be [T, k] float32, got {weights.dtype}{list(weights.shape)}")
    num_slots = weights.shape[0] * weights.shape[1]
    check_index(dest, COMBINE, "dest", (num_slots,))
    check_index(pos, COMBINE, "pos", (num_slots,))
    out_dtype = jnp.dtype(out_dtype)
    check(out_dtype in FLOAT_DTYPES, COMBINE, "out_dtype",
           f"must be float32/bfloat16/float16, got {out_dtype}")
    check(start >= 0, COMBINE, "start", f"must be >= 0, got {start}")
    attrs = _CombineAttrs(int(start), out_dtype, impl, platform)
    if impl != "reference":
        require_handlers(COMBINE, platform)
    return _combine(attrs, *same_varying(cap_ret, spill_ret, dest, pos, weights))


class _CombineAttrs(NamedTuple):
    start: int
    out_dtype: jnp.dtype
    impl: str
    platform: str | None


def _combine_call(attrs: _CombineAttrs, cap_ret, spill_ret, dest, pos, weights):
    if attrs.impl == "reference":
        return refs.combine(cap_ret, spill_ret, dest, pos, weights, start=attrs.start,
                            out_dtype=attrs.out_dtype)
    out_type = jax.ShapeDtypeStruct((weights.shape[0], cap_ret.shape[2]), attrs.out_dtype)
    return call_ffi(COMBINE, out_type, (cap_ret, spill_ret, dest, pos, weights),
                     dict(start=np.int64(attrs.start)), vmap_method="sequential")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(attrs, cap_ret, spill_ret, dest, pos, weights):
    return _combine_call(attrs, cap_ret, spill_ret, dest, pos, weights)


def _combine_fwd(attrs, cap_ret, spill_ret, dest, pos, weights):
    out = _combine_call(attrs, cap_ret, spill_ret, dest, pos, weights)
    return out, (cap_ret, spill_ret, dest, pos, weights)


def _combine_bwd(attrs, residuals, g):
    """combine's transpose: the rows' gradient is a pack of the output
    gradient scaled by each pick's weight; the weights' is a per-pick dot of
    the output gradient with the row the pick read."""
    cap_ret, spill_ret, dest, pos, weights = residuals
    d_cap, d_spill, d_weights = transposes.combine_cotangents(
        g, cap_ret, spill_ret, dest, pos, weights, start=attrs.start)
    return d_cap, d_spill, None, None, d_weights


_combine.defvjp(_combine_fwd, _combine_bwd)

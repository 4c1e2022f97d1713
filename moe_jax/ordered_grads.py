"""Weight gradients summed in one fixed order, whatever the parallelism.

With `MoEConfig.matmul="row_invariant"` every strategy computes an expert's
weight gradient the same way: one float32 partial per (expert, source rank)
over that source's rows in stream order, then the partials added in
source-rank order. The expert-parallel strategies receive every source's
rows and form the partials there; `dense` over a mesh forms its own rank's
partial and adds the ranks' partials in the same order
(`replicate_for_ranks`). So on a given mesh the weight gradients, and
with them training, have the same bits on every strategy (another EP size
splits the rows into other partials, whose sum may round differently).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax import manual_axes, row_invariant
from moe_jax.rounding import as_float32


class SourceSizes(NamedTuple):
    """Which source rank each expert's rows came from.

    sizes: [E_local, S] int32: rows of local expert e from source s; the
      rows of a group are those of its sources in order (expert-major,
      then source, then stream position).
    max_rows: a static bound on any one (expert, source) count.
    """

    sizes: jax.Array
    max_rows: int


def ordered_sum(parts: jax.Array, axis: int) -> jax.Array:
    """parts summed along `axis` left to right: ((p0 + p1) + p2) + ..."""
    acc = jnp.take(parts, 0, axis=axis)
    for i in range(1, parts.shape[axis]):
        acc = acc + jnp.take(parts, i, axis=axis)
    return acc


def source_weight_grads(a: jax.Array, d: jax.Array, sources: SourceSizes,
                        platform: str | None = None) -> jax.Array:
    """[E, S, K, N] float32: a_(e,s)^T @ d_(e,s) over each (expert, source) group.

    Args:
      a: [M, K] rows (a matmul's input), sorted as SourceSizes describes.
      d: [M, N] the matmul output's gradient rows, same order.
      sources: the groups; rows past them are ignored.
    Each partial sums its group's rows in increasing order (the
    row-invariant matmul, its rows padded at the end with zeros, which add
    nothing), so it depends on those rows alone: not on where the group
    starts, on the other groups, or on M.
    """
    num_experts, num_sources = sources.sizes.shape
    if a.shape[0] == 0:
        return jnp.zeros((num_experts, num_sources, a.shape[1], d.shape[1]), jnp.float32)
    groups = num_experts * num_sources
    rows = max(min(int(sources.max_rows), a.shape[0]), 1)
    sizes = jnp.maximum(sources.sizes.reshape(-1), 0)
    starts = jnp.cumsum(sizes) - sizes
    index = starts[:, None] + jnp.arange(rows, dtype=sizes.dtype)[None, :]
    valid = (jnp.arange(rows)[None, :] < sizes[:, None]) & (index < a.shape[0])
    index = jnp.clip(index, 0, a.shape[0] - 1)

    def gather(v):
        picked = as_float32(v)[index]
        return jnp.where(valid[..., None], picked, 0.0)

    a_t = jnp.swapaxes(gather(a), 1, 2).reshape(groups * a.shape[1], rows)
    depth = jnp.full((groups,), a.shape[1], jnp.int32)
    out = row_invariant.grouped_matmul(a_t, gather(d), depth, platform=platform)
    return out.reshape(num_experts, num_sources, a.shape[1], d.shape[1])


def replicate_for_ranks(w: jax.Array, ranks: int) -> jax.Array:
    """[G, ...] -> [ranks * G, ...]: one copy per rank, to be split over the
    ranks (each rank's copy its own, not a replicated value). The gradient
    adds the ranks' copies' gradients in rank order (ordered_sum), where a
    replicated value would get XLA's all-reduce, whose order is its own."""
    return _replicate(w, ranks)


def _replicate_primal(w, ranks):
    return jnp.broadcast_to(w[None], (ranks,) + w.shape).reshape((ranks * w.shape[0],)
                                                                  + w.shape[1:])


_replicate = jax.custom_vjp(_replicate_primal, nondiff_argnums=(1,))


def _replicate_fwd(w, ranks):
    return _replicate_primal(w, ranks), None


def _replicate_bwd(ranks, _, g):
    return (ordered_sum(g.reshape((ranks, g.shape[0] // ranks) + g.shape[1:]), 0),)


_replicate.defvjp(_replicate_fwd, _replicate_bwd)


def summed_to(grad: jax.Array, weight: jax.Array) -> jax.Array:
    """grad summed over the manual axes it varies along and weight does not
    (a replicated weight: XLA's all-reduce, as autodiff would add)."""
    extra = tuple(sorted(manual_axes.varying_axes(grad) - manual_axes.varying_axes(weight)))
    return jax.lax.psum(grad, extra) if extra else grad


def ordered_matmul(x: jax.Array, w: jax.Array, platform: str | None = None) -> jax.Array:
    """Row-invariant x @ w ([M, K] x [K, N] float32 -> [M, N] float32) whose
    gradients are too: dx row by row (row_invariant.matmul with w^T), dw as
    x^T dy summed over the rows in increasing order. XLA's dot would pick
    its own summation order per program (on GPUs: per autotuned algorithm),
    so the same rows could get other bits in another layer's program."""
    return _ordered_matmul(x, w, platform)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ordered_matmul(x, w, platform):
    return row_invariant.matmul(x, w, platform=platform)


def _ordered_matmul_fwd(x, w, platform):
    return _ordered_matmul(x, w, platform), (x, w)


def _ordered_matmul_bwd(platform, residuals, dy):
    x, w = residuals
    dx = row_invariant.matmul(dy, jnp.swapaxes(w, 0, 1), platform=platform)
    # Row k of x^T @ dy sums over the rows of x in increasing order.
    dw = row_invariant.matmul(jnp.swapaxes(x, 0, 1), dy, platform=platform)
    return dx.astype(x.dtype), summed_to(dw, w).astype(w.dtype)


_ordered_matmul.defvjp(_ordered_matmul_fwd, _ordered_matmul_bwd)

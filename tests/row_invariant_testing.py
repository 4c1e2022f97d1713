"""Shared helpers of the moe_jax_row_matmul tests (CPU and GPU)."""

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import row_invariant
from moe_testing import bits

DTYPES = [jnp.float32, jnp.bfloat16]


def random_case(rng, sizes, rows, depth, cols, dtype):
    """x [rows, depth], w [G, depth, cols] from standard normals (never zeros)."""
    x = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), depth, cols)), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


def group_rows(sizes, rows):
    """[begin, end) of each group's rows: sizes clamped at 0, cut to [0, rows)."""
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), rows)
    return list(zip(np.concatenate([[0], ends[:-1]]), ends)), int(ends[-1]) if len(ends) else 0


def run(x, w, sizes, impl="custom_call", backend="cpu"):
    """grouped_matmul under jit on the first device of `backend`, as numpy."""
    x, w, sizes = jax.device_put((x, w, sizes), jax.devices(backend)[0])
    fn = jax.jit(lambda x, w, s: row_invariant.grouped_matmul(x, w, s, impl=impl,
                                                              platform=backend))
    return np.asarray(fn(x, w, sizes))


def sequential_float32_sum(x, w, sizes):
    """The CPU handler's arithmetic in numpy: per output, +0.0f then
    acc = acc + x[i, k] * w[g, k, n] for k in increasing order, each rounded."""
    x32 = np.asarray(x.astype(jnp.float32))
    w32 = np.asarray(w.astype(jnp.float32))
    out = np.zeros((x32.shape[0], w32.shape[2]), np.float32)
    ranges, _ = group_rows(sizes, x32.shape[0])
    for g, (begin, end) in enumerate(ranges):
        acc = np.zeros((end - begin, w32.shape[2]), np.float32)
        for k in range(x32.shape[1]):
            acc = acc + x32[begin:end, k:k + 1] * w32[g, k][None, :]
        out[begin:end] = acc
    return out


def assert_close_to_reference(got, x, w, sizes, backend="cpu"):
    """|got - ragged_dot| within (K + 16) * 2^-20 * (|x| @ |w|) elementwise: a
    few times the worst case of float32 sums in any order."""
    want = run(x, w, sizes, impl="reference", backend=backend)
    abs_prod = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).max(0)
    tol = (x.shape[1] + 16) * 2.0**-20 * abs_prod + 1e-30
    assert np.all(np.abs(got.astype(np.float64) - want) <= tol)


def subset_case(rng, x, sizes):
    """A random subset of the grouped rows (still sorted by group), its group
    sizes and some extra padding rows of random data after them."""
    total = int(sum(sizes))
    keep = rng.random(total) < 0.5
    group_of = np.repeat(np.arange(len(sizes)), sizes)
    sub_sizes = np.bincount(group_of[keep], minlength=len(sizes)).astype(np.int32)
    padding = jnp.asarray(rng.standard_normal((int(rng.integers(0, 4)), x.shape[1])), x.dtype)
    sub_x = jnp.concatenate([x[:total][np.flatnonzero(keep)], padding])
    return keep, sub_x, jnp.asarray(sub_sizes)


def assert_rows_invariant(rng, x, w, sizes, run_fn):
    """Rows of a call on a subset equal bitwise the same rows of the full call."""
    full = run_fn(x, w, jnp.asarray(sizes, jnp.int32))
    keep, sub_x, sub_sizes = subset_case(rng, x, sizes)
    sub = run_fn(sub_x, w, sub_sizes)
    kept = int(keep.sum())
    np.testing.assert_array_equal(bits(sub[:kept]), bits(full[:len(keep)][keep]))
    assert not bits(sub[kept:]).any()

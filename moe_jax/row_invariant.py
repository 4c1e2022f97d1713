"""Row-invariant grouped matmul: the custom call `moe_jax_row_matmul`.

On GPU, XLA's dots (jnp.dot, lax.ragged_dot) are not row-invariant: the bits
of an output row change with the number of rows in the call, because the
autotuner and cuBLAS pick other tilings, split-K or a GEMV for other shapes.
The matmul here fixes the arithmetic of every output row: it depends on that
input row and its group's weights only. Semantics and cost:
docs/design/custom_calls.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.ops.ffi import call_ffi, check, require_handlers

ROW_MATMUL = "moe_jax_row_matmul"

INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
IMPLS = ("custom_call", "reference")


def grouped_matmul(x, w, group_sizes=None, *, impl: str = "custom_call",
                   platform: str | None = None) -> jax.Array:
    """Grouped matmul whose every output row is bitwise a function of its row.

    Args:
      x: [M, K] bfloat16 or float32 rows, sorted by group.
      w: [G, K, N] weights, dtype of x.
      group_sizes: [G] int32 rows of each group, in order: group g owns rows
        [s_g, s_g + group_sizes[g]) with s_g the sum of the earlier sizes
        (negative sizes count as 0, rows past M are cut off). None when
        G == 1: all M rows use w[0].
      impl: "custom_call" (the FFI handler of the platform) or "reference"
        (lax.ragged_dot at HIGHEST precision with float32 results: equal
        within rounding, not row-invariant).
      platform: platform whose handler must exist ("cpu", "gpu"); default
        the default backend.
    Returns:
      [M, N] float32: row i = x[i] @ w[g(i)] accumulated in float32; rows at
      index >= sum(group_sizes) are +0.0.

    Guarantee (impl="custom_call"): on one platform, output row i is, bit for
    bit, a function of x[i] and w[g(i)] only: independent of M, of the other
    rows, of the other groups' sizes, and of whether the call runs under jit,
    inside shard_map or inside a CUDA graph. The float32 sums run over k in
    increasing order (on CUDA with bfloat16 inputs, in tensor-core steps of
    16 in increasing order: on Hopper GPUs, with K and N multiples of 8, the
    CUTLASS grouped GEMM of moe_jax.ops.grouped_matmul, else this module's
    kernel). Graph-capturable on CUDA: the launches' shapes depend on
    (M, G, N) only, no allocation, no synchronization; group_sizes is read on
    the device. Differentiable: the gradients are lax.ragged_dot's transposes
    (the CUTLASS kernels' own on the CUTLASS path).
    """
    check(impl in IMPLS, ROW_MATMUL, "impl", f"must be one of {IMPLS}, got {impl!r}")
    check(x.ndim == 2 and x.dtype in INPUT_DTYPES, ROW_MATMUL, "x",
           f"must be a [M, K] float32/bfloat16 array, got {x.dtype}{list(x.shape)}")
    num_rows, depth = x.shape
    check(w.ndim == 3 and w.dtype == x.dtype and w.shape[1] == depth, ROW_MATMUL, "w",
           f"must be [G, K={depth}, N] {x.dtype} (x's dtype and K), "
           f"got {w.dtype}{list(w.shape)}")
    num_groups, _, cols = w.shape
    group_sizes = _group_sizes_or_all_rows(group_sizes, num_groups, num_rows)
    if impl == "reference":
        return _reference(x, w, group_sizes)
    from moe_jax.ops import grouped_matmul as gmm  # noqa: PLC0415 (it imports this module)
    if gmm.cutlass_applies(x.dtype, depth, cols, platform):
        return gmm.grouped_matmul(x, w, group_sizes, out_dtype=jnp.float32, impl="cutlass",
                                  platform=platform)
    require_handlers(ROW_MATMUL, platform)
    return _row_matmul(x, w, group_sizes)


@jax.custom_vjp
def _row_matmul(x, w, group_sizes):
    out_type = jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32)
    return call_ffi(ROW_MATMUL, out_type, (x, w, group_sizes), {},
                     vmap_method="sequential")


def _row_matmul_fwd(x, w, group_sizes):
    return _row_matmul(x, w, group_sizes), (x, w, group_sizes)


def _row_matmul_bwd(residuals, dy):
    x, w, group_sizes = residuals
    _, pullback = jax.vjp(lambda a, b: _reference(a, b, group_sizes), x, w)
    dx, dw = pullback(dy.astype(jnp.float32))
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_row_matmul.defvjp(_row_matmul_fwd, _row_matmul_bwd)


def matmul(x, w, *, impl: str = "custom_call", platform: str | None = None) -> jax.Array:
    """Row-invariant x @ w: [M, K] x [K, N] -> [M, N] float32.

    x and w are both float32 or both bfloat16. The grouped_matmul guarantee
    with a single group: row i is bitwise a function of x[i] and w only.
    Graph-capturable on CUDA.
    """
    check(w.ndim == 2, ROW_MATMUL, "w", f"must be a [K, N] array, got {w.dtype}{list(w.shape)}")
    return grouped_matmul(x, w[None], None, impl=impl, platform=platform)


def _group_sizes_or_all_rows(group_sizes, num_groups: int, num_rows: int):
    """[G] int32 group sizes; None stands for one group holding all rows."""
    if group_sizes is None:
        check(num_groups == 1, ROW_MATMUL, "group_sizes",
               f"may be None only when w has G = 1 group, got G = {num_groups}")
        return jnp.full((1,), num_rows, jnp.int32)
    group_sizes = jnp.asarray(group_sizes)
    check(group_sizes.dtype == jnp.int32 and tuple(group_sizes.shape) == (num_groups,),
           ROW_MATMUL, "group_sizes",
           f"must be int32 of shape [G] = [{num_groups}] (G of w), "
           f"got {group_sizes.dtype}{list(group_sizes.shape)}")
    return group_sizes


def _reference(x, w, group_sizes):
    """lax.ragged_dot (HIGHEST precision: no TF32 for float32 inputs) with
    float32 results, the same row ranges and the zero tail."""
    return ragged_dot_f32(x, w, group_sizes, jax.lax.Precision.HIGHEST)


def ragged_dot_f32(x, w, group_sizes, precision=None):
    """lax.ragged_dot with float32 results over the row ranges of
    grouped_matmul (negative sizes as 0, cut at M) and +0.0 rows past them."""
    num_rows, cols = x.shape[0], w.shape[2]
    if w.shape[0] == 0 or num_rows == 0:
        return jnp.zeros((num_rows, cols), jnp.float32)
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), num_rows)
    sizes = jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))
    out = jax.lax.ragged_dot(x, w, sizes, precision=precision,
                             preferred_element_type=jnp.float32)
    inside = jnp.arange(num_rows, dtype=jnp.int32) < ends[-1]
    return jnp.where(inside[:, None], out, jnp.float32(0))

"""Grouped matmuls of rows sorted by group: the experts' GEMMs.

`grouped_matmul(x, w, group_sizes)` multiplies each group's rows by that
group's weights; `swiglu(x, w_gate_up, group_sizes)` is the fused first half
of a SwiGLU expert (gate and up projections in one GEMM whose epilogue
writes silu(gate) * up). Group sizes stay on the device.

Implementations (`impl`):
  "cutlass": the custom call `moe_jax_grouped_matmul` (CUDA, Hopper GPUs,
    bfloat16/float16 inputs): CUTLASS's SM90 grouped GEMM (TMA loads,
    warpgroup MMA, warp-specialized persistent kernel) with the groups'
    problem shapes built on the device. Row-invariant: the tile
    configuration is fixed per op and dtype (never chosen from M or the
    group sizes) and K is never split, so each output row's bits depend
    only on its input row and its group's weights. Graph-capturable.
  "row_invariant": a row-invariant matmul on every platform:
    `moe_jax.row_invariant.grouped_matmul` ("cutlass" where it applies, else
    the `moe_jax_row_matmul` custom call: the CPU handler, or the CUDA
    kernel for float32, unaligned shapes and non-Hopper GPUs).
  "xla": `jax.lax.ragged_dot` (on GPU, jaxlib 0.11.2 lowers it to a dense
    matmul over every group; not row-invariant).
  "auto": "cutlass" where it applies (GPU platform with a Hopper GPU,
    bfloat16/float16, K and N multiples of 8), else "xla"; except where the
    grouped kernel would have fewer tiles than the GPU has SMs (G groups of
    N / 256 column tiles) and the rows are few (`dense_instead`: M <=
    SINGLE_GROUP_DENSE_ROWS for one group, M <= FEW_GROUPS_DENSE_ROWS and
    G * M <= FEW_GROUPS_DENSE_WORK for several; M is static): then every
    row is multiplied by every group's weights in one batched XLA matmul
    (cuBLAS) and each row keeps its own group's float32 result, the rows
    past the groups zeroed. The kernel cannot stream the weights at full
    bandwidth over so few tiles, while the dense matmul at these M reads
    the weights once and costs no more (docs/design/custom_calls.md).

Every implementation is differentiable (custom VJPs: the input gradient is
the grouped matmul with transposed weights, the weight gradient a per-group
x^T dy; with "cutlass" both run as CUTLASS grouped GEMMs). Rows past
sum(group_sizes) are padding: their outputs are zero and they receive no
gradient.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from moe_jax import row_invariant
from moe_jax.ops.ffi import available_platforms, call_ffi, check, require_handlers

GROUPED_MATMUL = "moe_jax_grouped_matmul"
IMPLS = ("auto", "cutlass", "row_invariant", "xla")
CUTLASS_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SINGLE_GROUP_DENSE_ROWS = 512
FEW_GROUPS_DENSE_ROWS = 256
FEW_GROUPS_DENSE_WORK = 1024
CUTLASS_TILE_N = 256
_DEFAULT_SM_COUNT = 132
_GATE_UP_BLOCK = 8


def gate_up_block(ffn_size: int) -> int:
    """Columns per gate/up block of a fused [.., H, 2F] SwiGLU weight: 8 when
    F is a multiple of 8 (the layout the CUTLASS epilogue reads), else
    gcd(F, 8)."""
    return math.gcd(int(ffn_size), _GATE_UP_BLOCK)


def fuse_gate_up(w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
    """[..., H, F] gate and up weights -> the fused [..., H, 2F] weight.

    Columns alternate blocks of b = gate_up_block(F) gate columns and the b
    up columns of the same indices: [g_0..g_b-1, u_0..u_b-1, g_b.., u_b..].
    """
    check(w_gate.shape == w_up.shape and w_gate.ndim >= 2, "fuse_gate_up", "w_up",
           f"must have w_gate's shape {list(w_gate.shape)}, got {list(w_up.shape)}")
    *lead, ffn = w_gate.shape
    block = gate_up_block(ffn)
    pair = jnp.stack([w_gate.reshape(*lead, ffn // block, block),
                      w_up.reshape(*lead, ffn // block, block)], axis=-2)
    return pair.reshape(*lead, 2 * ffn)


def split_gate_up(w_gate_up: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The inverse of fuse_gate_up: [..., 2F] -> ([..., F] gate, [..., F] up)."""
    *lead, two_f = w_gate_up.shape
    check(two_f % 2 == 0, "split_gate_up", "w_gate_up",
           f"must have an even last dimension 2F, got {list(w_gate_up.shape)}")
    ffn = two_f // 2
    block = gate_up_block(ffn)
    pair = w_gate_up.reshape(*lead, ffn // block, 2, block)
    return pair[..., 0, :].reshape(*lead, ffn), pair[..., 1, :].reshape(*lead, ffn)


def _on_hopper(platform: str) -> bool:
    if platform != "gpu":
        return False
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return False
    return bool(devices) and getattr(devices[0], "compute_capability", None) == "9.0"


def _platform(platform: str | None) -> str:
    p = (platform or jax.default_backend()).lower()
    return "cpu" if p == "cpu" else "gpu"


def cutlass_applies(dtype, k: int, n: int, platform: str | None = None) -> bool:
    """Whether impl="auto" picks the CUTLASS kernel for [M, k] x [G, k, n]."""
    platform = _platform(platform)
    return (jnp.dtype(dtype) in CUTLASS_DTYPES and k % 8 == 0 and n % 8 == 0
            and _on_hopper(platform) and "cuda" in available_platforms())


def _resolve(impl: str, dtype, k: int, n: int, platform: str | None) -> str:
    check(impl in IMPLS, GROUPED_MATMUL, "impl", f"must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "cutlass" if cutlass_applies(dtype, k, n, platform) else "xla"
    if impl == "row_invariant":
        return "cutlass" if cutlass_applies(dtype, k, n, platform) else "row_matmul"
    if impl == "cutlass":
        plat = _platform(platform)
        check(plat == "gpu" and _on_hopper(plat), GROUPED_MATMUL, "impl",
               "'cutlass' needs a Hopper GPU (compute capability 9.0) as the platform, got "
               f"platform {plat!r}")
        check(jnp.dtype(dtype) in CUTLASS_DTYPES, GROUPED_MATMUL, "x",
               f"must be bfloat16 or float16 for impl='cutlass', got {jnp.dtype(dtype)}")
        check(k % 8 == 0 and n % 8 == 0, GROUPED_MATMUL, "w",
               f"needs K and N multiples of 8 for impl='cutlass' (16-byte rows), got K={k}, N={n}")
    return impl


@functools.lru_cache(maxsize=None)
def gpu_sm_count() -> int:
    """Streaming multiprocessors of the first GPU (132 if it cannot be read)."""
    try:
        count = getattr(jax.devices("gpu")[0], "core_count", None)
    except RuntimeError:
        count = None
    return int(count) if count else _DEFAULT_SM_COUNT


def dense_instead(num_groups: int, rows: int, n: int, sm_count: int | None = None) -> bool:
    """Whether impl="auto", where it would run the CUTLASS kernel on
    [rows, K] x [num_groups, K, n], runs the batched dense matmul instead:
    the kernel would have fewer tiles than the GPU has SMs and the dense
    matmul's extra rows (every row times every group) stay cheap."""
    if num_groups < 1 or num_groups * -(-n // CUTLASS_TILE_N) >= (sm_count or gpu_sm_count()):
        return False
    if num_groups == 1:
        return rows <= SINGLE_GROUP_DENSE_ROWS
    return rows <= FEW_GROUPS_DENSE_ROWS and num_groups * rows <= FEW_GROUPS_DENSE_WORK


def _runs_dense(impl: str, which: str, x, w) -> bool:
    return (impl == "auto" and which == "cutlass"
            and dense_instead(w.shape[0], x.shape[0], w.shape[2]))


def _dense_groups(x, w, group_sizes):
    """[M, N] float32: row i = x[i] @ w[g(i)], the rows past the groups zero.

    Every row is multiplied by every group's weights (one batched matmul),
    then each keeps its group's result."""
    num_groups, rows = w.shape[0], x.shape[0]
    every = jax.lax.dot_general(jnp.broadcast_to(x, (num_groups,) + x.shape), w,
                                (((2,), (1,)), ((0,), (0,))),
                                preferred_element_type=jnp.float32)
    ends = jnp.cumsum(jnp.maximum(group_sizes, 0))
    group = jnp.sum(jnp.arange(rows)[:, None] >= ends[None, :], axis=1)
    own = jnp.take_along_axis(every, jnp.minimum(group, num_groups - 1)[None, :, None],
                              axis=0)[0]
    return jnp.where((group < num_groups)[:, None], own, 0.0)


def _check_operands(x, w, group_sizes):
    check(x.ndim == 2 and jnp.issubdtype(x.dtype, jnp.floating), GROUPED_MATMUL, "x",
           f"must be a [M, K] floating array, got {x.dtype}{list(x.shape)}")
    check(w.ndim == 3 and w.dtype == x.dtype and w.shape[1] == x.shape[1], GROUPED_MATMUL, "w",
           f"must be [G, K={x.shape[1]}, N] {x.dtype} (x's dtype and K), "
           f"got {w.dtype}{list(w.shape)}")
    group_sizes = jnp.asarray(group_sizes)
    check(group_sizes.dtype == jnp.int32 and tuple(group_sizes.shape) == (w.shape[0],),
           GROUPED_MATMUL, "group_sizes",
           f"must be int32 of shape [G] = [{w.shape[0]}] (G of w), "
           f"got {group_sizes.dtype}{list(group_sizes.shape)}")
    return group_sizes


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, out_dtype=None,
                   impl: str = "auto", platform: str | None = None) -> jax.Array:
    """out[i] = x[i] @ w[g(i)] for rows sorted by group.

    Args:
      x: [M, K] rows (bfloat16, float16 or float32), sorted by group.
      w: [G, K, N] weights, dtype of x.
      group_sizes: [G] int32 on the device: group g owns rows [s_g, s_g + n_g)
        with n_g = max(group_sizes[g], 0) and s_g the sum of the earlier
        n's; rows past M are cut off.
      out_dtype: dtype of the result (default x.dtype); the accumulation is
        float32 in every implementation.
      impl: see the module docstring.
      platform: "cpu" or "gpu" (default: the default backend).
    Returns:
      [M, N] out_dtype; rows past sum(group_sizes) are zero.
    """
    group_sizes = _check_operands(x, w, group_sizes)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    which = _resolve(impl, x.dtype, x.shape[1], w.shape[2], platform)
    if _runs_dense(impl, which, x, w):
        return _dense_groups(x, w, group_sizes).astype(out_dtype)
    if which == "cutlass":
        check(out_dtype in (jnp.dtype(jnp.float32), jnp.dtype(x.dtype)), GROUPED_MATMUL,
               "out_dtype", f"must be float32 or x's dtype for impl='cutlass', got {out_dtype}")
        return _cutlass_matmul(x, w, group_sizes, out_dtype)
    if which == "row_matmul":
        return row_invariant.grouped_matmul(x, w, group_sizes,
                                            platform=platform).astype(out_dtype)
    return _ragged_dot(x, w, group_sizes).astype(out_dtype)


def swiglu(x: jax.Array, w_gate_up: jax.Array, group_sizes: jax.Array, *,
           impl: str = "auto", platform: str | None = None) -> jax.Array:
    """silu(x @ gate) * (x @ up) per group, from the fused weight.

    Args:
      x: [M, K] rows sorted by group.
      w_gate_up: [G, K, 2F] fused gate/up weights (fuse_gate_up), dtype of x.
      group_sizes: [G] int32 (see grouped_matmul).
      impl, platform: see grouped_matmul. With "cutlass" the product, silu
        and multiply run in one kernel (float32 until the final rounding).
    Returns:
      [M, F] in x's dtype; rows past sum(group_sizes) are zero.
    """
    group_sizes = _check_operands(x, w_gate_up, group_sizes)
    two_f = w_gate_up.shape[2]
    check(two_f % 2 == 0, GROUPED_MATMUL, "w_gate_up",
           f"must have an even last dimension 2F, got {list(w_gate_up.shape)}")
    which = _resolve(impl, x.dtype, x.shape[1], two_f, platform)
    if _runs_dense(impl, which, x, w_gate_up):
        gate, up = split_gate_up(_dense_groups(x, w_gate_up, group_sizes))
        return (jax.nn.silu(gate) * up).astype(x.dtype)
    if which == "cutlass" and gate_up_block(two_f // 2) == _GATE_UP_BLOCK:
        return _cutlass_swiglu(x, w_gate_up, group_sizes)
    if which == "cutlass":
        which = "xla"
    if which == "row_matmul":
        h = row_invariant.grouped_matmul(x, w_gate_up, group_sizes, platform=platform)
    elif which == "cutlass":
        h = _cutlass_matmul(x, w_gate_up, group_sizes, jnp.dtype(jnp.float32))
    else:
        h = _ragged_dot(x, w_gate_up, group_sizes)
    gate, up = split_gate_up(h)
    return (jax.nn.silu(gate) * up).astype(x.dtype)


# --- XLA -------------------------------------------------------------------

def _ragged_dot(x, w, group_sizes):
    """lax.ragged_dot, float32 results, zero tail (HIGHEST precision for
    float32 inputs: no TF32)."""
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return row_invariant.ragged_dot_f32(x, w, group_sizes, precision)


# --- moe_jax_grouped_matmul (CUTLASS) --------------------------------------

def _workspace_bytes(num_groups: int) -> int:
    from moe_jax import _ffi_cuda
    return int(_ffi_cuda.grouped_matmul_workspace_bytes(num_groups))


def _cutlass_call(op: str, a, b, group_sizes, out_shape, out_dtype):
    require_handlers(GROUPED_MATMUL, "gpu")
    out_types = (jax.ShapeDtypeStruct(out_shape, out_dtype),
                 jax.ShapeDtypeStruct((_workspace_bytes(group_sizes.shape[0]),), jnp.uint8))
    out, _ = call_ffi(GROUPED_MATMUL, out_types, (a, b, group_sizes), {"op": op},
                       vmap_method="sequential")
    return out


def _forward(x, w, group_sizes, out_dtype):
    return _cutlass_call("forward", x, w, group_sizes, (x.shape[0], w.shape[2]), out_dtype)


def _input_grad(dy, w, group_sizes):
    return _cutlass_call("transposed", dy, w, group_sizes, (dy.shape[0], w.shape[1]), dy.dtype)


def _weight_grad(x, dy, group_sizes):
    """[G, K, N] x's dtype: float32 sums rounded once in the epilogue."""
    shape = (group_sizes.shape[0], x.shape[1], dy.shape[1])
    return _cutlass_call("weight_grad", x, dy, group_sizes, shape, x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cutlass_matmul(x, w, group_sizes, out_dtype):
    return _forward(x, w, group_sizes, out_dtype)


def _cutlass_matmul_fwd(x, w, group_sizes, out_dtype):
    return _forward(x, w, group_sizes, out_dtype), (x, w, group_sizes)


def _cutlass_matmul_bwd(out_dtype, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    dx = _input_grad(dy, w, group_sizes)
    dw = _weight_grad(x, dy, group_sizes).astype(w.dtype)
    return dx, dw, None


_cutlass_matmul.defvjp(_cutlass_matmul_fwd, _cutlass_matmul_bwd)


@jax.custom_vjp
def _cutlass_swiglu(x, w_gate_up, group_sizes):
    out_shape = (x.shape[0], w_gate_up.shape[2] // 2)
    return _cutlass_call("swiglu", x, w_gate_up, group_sizes, out_shape, x.dtype)


def _cutlass_swiglu_fwd(x, w_gate_up, group_sizes):
    return _cutlass_swiglu(x, w_gate_up, group_sizes), (x, w_gate_up, group_sizes)


def _cutlass_swiglu_bwd(residuals, dh):
    x, w_gate_up, group_sizes = residuals
    # The gate and up pre-activations are recomputed (float32), not stored.
    gate, up = split_gate_up(_forward(x, w_gate_up, group_sizes, jnp.dtype(jnp.float32)))
    dh = dh.astype(jnp.float32)
    sig = jax.nn.sigmoid(gate)
    d_up = dh * gate * sig
    d_gate = dh * up * sig * (1.0 + gate * (1.0 - sig))
    d_gate_up = fuse_gate_up(d_gate, d_up).astype(x.dtype)
    dx = _input_grad(d_gate_up, w_gate_up, group_sizes)
    dw = _weight_grad(x, d_gate_up, group_sizes).astype(w_gate_up.dtype)
    return dx, dw, None


_cutlass_swiglu.defvjp(_cutlass_swiglu_fwd, _cutlass_swiglu_bwd)

"""The fp8 dispatch format: e4m3 values with one float32 scale per 128
elements (what `MoEConfig(dispatch_fp8=True)` sends over NVLink; see
moe_jax/nvlink.py)."""

from __future__ import annotations

import jax.numpy as jnp

FP8_BLOCK = 128
FP8_MAX = 448.0


def quantize_e4m3(x):
    """Reference of the fp8 dispatch format: x [..., H] (H % 128 == 0) ->
    (values [..., H] float8_e4m3fn, scales [..., H / 128] float32).

    Bit-exact with the CUDA quantizer when run on the CPU backend; XLA's GPU
    backend may round the float32 -> e4m3 conversion differently."""
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, FP8_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    nonzero = amax > 0
    safe = jnp.where(nonzero, amax, jnp.float32(1))
    inverse = jnp.where(nonzero, jnp.float32(FP8_MAX) / safe, jnp.float32(1))
    scales = jnp.where(nonzero, safe * jnp.float32(1 / FP8_MAX), jnp.float32(1))
    values = (blocks * inverse[..., None]).astype(jnp.float8_e4m3fn)
    return values.reshape(x.shape), scales


def dequantize(rows, scales, dtype=jnp.bfloat16):
    """fp8 rows [N, H] and scales [N, H / 128] -> [N, H] values (float32
    products rounded once to `dtype`)."""
    blocks = rows.astype(jnp.float32).reshape(rows.shape[0], -1, FP8_BLOCK)
    return (blocks * scales[..., None]).reshape(rows.shape).astype(dtype)

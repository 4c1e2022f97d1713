"""float32 views of narrow floats that keep their rounding under XLA.

With `xla_allow_excess_precision` (on by default) XLA:GPU drops a
float32 -> bfloat16 -> float32 convert pair, so a value rounded to
bfloat16 in one fusion can reach the next as its unrounded float32. Where
bits must not depend on how XLA fuses (the ordered gradients, the combine
transposes), a narrow value is widened with `as_float32`, whose explicit
rounding XLA keeps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_FLOAT16_MAX = 65504.0
_FLOAT16_MIN_NORMAL = 2.0 ** -14
_FLOAT16_SUBNORMAL_STEP = 2.0 ** -24


def as_float32(v: jax.Array) -> jax.Array:
    """v as float32, bit for bit the values of v's dtype (any shape).

    bfloat16 and float16 are rounded to their format once more after the
    widening (`round_to`: a no-op on values already in it, and a rounding
    XLA cannot drop); float32 is returned as is.
    """
    return round_to(v.astype(jnp.float32), v.dtype)


def round_to(wide: jax.Array, dtype) -> jax.Array:
    """float32 `wide` rounded to the values of `dtype` (bfloat16, float16 or
    float32), to nearest even as a conversion would, kept in float32.

    bfloat16 shares float32's exponent range: one reduce-precision to its 7
    mantissa bits. float16: 10 mantissa bits at float32's exponent range,
    magnitudes past its largest finite value to infinity, and below its
    smallest normal the subnormal grid of 2^-24 (reduce-precision to 5
    exponent bits would flush those to zero).
    """
    dtype = jnp.dtype(dtype)
    if dtype == jnp.dtype(jnp.bfloat16):
        return jax.lax.reduce_precision(wide, exponent_bits=8, mantissa_bits=7)
    if dtype == jnp.dtype(jnp.float16):
        normal = jax.lax.reduce_precision(wide, exponent_bits=8, mantissa_bits=10)
        normal = jnp.where(jnp.abs(normal) > _FLOAT16_MAX,
                           jnp.copysign(jnp.float32(jnp.inf), wide), normal)
        step = jnp.float32(_FLOAT16_SUBNORMAL_STEP)
        subnormal = jnp.round(wide * (1 / step)) * step
        return jnp.where(jnp.abs(wide) < _FLOAT16_MIN_NORMAL, subnormal, normal)
    if dtype == jnp.dtype(jnp.float32):
        return wide
    raise ValueError(f"round_to: argument 'dtype' must be bfloat16, float16 or float32, "
                     f"got {dtype}")

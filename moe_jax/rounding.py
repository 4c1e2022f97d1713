"""float32 views of narrow floats that keep their rounding under XLA.

With `xla_allow_excess_precision` (on by default) XLA:GPU drops a
float32 -> bfloat16 -> float32 convert pair, so a value rounded to
bfloat16 in one fusion can reach the next as its unrounded float32. Where
bits must not depend on how XLA fuses (the ordered gradients, the combine
transposes), a narrow value is widened with `as_float32`, whose explicit
rounding (a reduce-precision to the narrow format) XLA keeps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def as_float32(v: jax.Array) -> jax.Array:
    """v as float32, bit for bit the values of v's dtype (any shape).

    bfloat16 and float16 are rounded to their format once more after the
    widening (a no-op on values already in it); float32 is returned as is.
    """
    dtype = jnp.dtype(v.dtype)
    wide = v.astype(jnp.float32)
    if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        info = jnp.finfo(dtype)
        wide = jax.lax.reduce_precision(wide, exponent_bits=info.nexp,
                                        mantissa_bits=info.nmant)
    return wide

"""Data dependencies that order computations XLA would otherwise reorder.

`opaque_zero(x)` is an int32 0 that XLA cannot fold, computed from x;
`depend_on(tree, zero)` returns `tree` bit for bit, but only after `zero` is
known. Together they make one computation wait for another's result (for
example collectives that must be issued in the same order on every rank).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def opaque_zero(x: jax.Array) -> jax.Array:
    """An int32 0 computed from x's first element, which XLA cannot fold."""
    first = x.reshape(-1)[:1]
    if first.size == 0:
        return jnp.zeros((), jnp.int32)
    width = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[first.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(first, width)[0].astype(jnp.int32)
    return jnp.minimum(jnp.bitwise_and(bits, 0x7FFF), 0)


def depend_on(tree, zero: jax.Array):
    """`tree` unchanged bit for bit, but computed after `zero` is known."""
    return jax.tree.map(lambda a: jnp.where(zero == 0, a, jnp.zeros_like(a)), tree)

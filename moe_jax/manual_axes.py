"""Typing arrays as varying over shard_map's manual mesh axes.

Inside `jax.shard_map` every array's type records the manual axes it
varies over. Custom calls, custom VJPs and collectives demand operands (and
cotangents) of equal types, so the ops cast with these helpers first.
"""

from __future__ import annotations

import jax


def varying_axes(*arrays) -> frozenset:
    """Manual mesh axes (inside shard_map) any of the arrays varies over."""
    axes = frozenset()
    for a in arrays:
        mat = getattr(jax.typeof(a), "mat", None)
        if mat is not None:
            axes |= mat.varying
    return axes


def as_varying(x, axes):
    """x typed as varying over `axes` too (a no-op where it already is)."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def same_varying(*arrays, extra_axes=()):
    """The arrays typed as varying over the same manual axes (their union and
    extra_axes). A custom_vjp then sees operands and cotangents of one type;
    the casts' own transposes (sums over the added axes) stay outside it."""
    axes = varying_axes(*arrays) | frozenset(extra_axes)
    return [as_varying(a, axes) for a in arrays]

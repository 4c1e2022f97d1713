"""Initializers shared by the linen and nnx modules."""

from __future__ import annotations

import jax

router_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal")
# Stacked [E, in, out] expert matrices: fan-in over axis 1, experts batched.
expert_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=1,
                                                   out_axis=2, batch_axis=(0,))


def expert_axis_or_none(config):
    """The mesh axis expert weights are sharded over (None for "dense")."""
    return None if config.strategy == "dense" else config.expert_axis

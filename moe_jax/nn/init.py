"""Initializers shared by the linen and nnx modules."""

from __future__ import annotations

import jax
import jax.numpy as jnp

router_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal")
# Stacked [E, in, out] expert matrices: fan-in over axis 1, experts batched.
expert_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=1,
                                                   out_axis=2, batch_axis=(0,))


def expert_axis_or_none(config):
    """The mesh axis expert weights are sharded over (None for "dense")."""
    return None if config.strategy == "dense" else config.expert_axis


def gate_up_init(key, shape, dtype=jnp.float32):
    """The fused [E, H, 2F] gate/up weight (see ExpertWeights): gate and up
    drawn as two fan-in-scaled [E, H, F] matrices, then interleaved."""
    from moe_jax.ops.grouped_matmul import fuse_gate_up
    experts, hidden, two_f = shape
    k_gate, k_up = jax.random.split(key)
    half = (experts, hidden, two_f // 2)
    return fuse_gate_up(expert_init(k_gate, half, dtype), expert_init(k_up, half, dtype))


def on_slots(init, placement):
    """`init` of [E, ...] expert weights made an init of [P * S, ...] slot
    weights: the E experts drawn as without a placement, then copied to
    every slot that holds them (`placement`: PlacementArrays; None: `init`)."""
    if placement is None:
        return init

    def slot_init(key, shape, dtype=jnp.float32):
        logical = init(key, (placement.num_experts,) + tuple(shape[1:]), dtype)
        return jnp.take(logical, placement.slot_expert.reshape(-1), axis=0)

    return slot_init

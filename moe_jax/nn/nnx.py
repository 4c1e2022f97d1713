"""Flax nnx MoE module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import MoEConfig
from moe_jax.dispatch import DispatchStats
from moe_jax.experts import ExpertWeights
from moe_jax.layer import MoEParams, moe_layer
from moe_jax.nn.init import (expert_axis_or_none, expert_init, gate_up_init, on_slots,
                             router_init)
from moe_jax.replication import Placement, PlacementArrays


class MoEStats(nnx.Variable):
    """Dispatch counters accumulated over calls (not trained)."""


class MoEAuxLoss(nnx.Variable):
    """The weighted auxiliary loss of the last call."""


class MoEPlacement(nnx.Variable):
    """The placement's arrays (PlacementArrays; not trained): state, so a
    new placement of the same shapes does not recompile."""


class MoE(nnx.Module):
    """Router + dispatch strategy + stacked SwiGLU experts (nnx).

    Args:
      config: MoEConfig (validated when built).
      mesh: mesh holding config.expert_axis (not needed for "dense").
      rngs: nnx.Rngs for parameter initialization.
      placement: hot-expert replication (moe_jax.replication.Placement):
        the expert weights are then [P * S, ...], one per slot, each expert's
        copies initialized alike, and `placement` (a MoEPlacement variable)
        holds its arrays; after a rebalance, assign the moved weights and
        `set_placement` the new one. None: [E, ...] weights.
      replica_choice: "local" or "balanced" (see moe_layer), with a placement.

    Call: x [..., H] -> [..., H] in config.dtype. After a call, `aux_loss`
    holds the weighted auxiliary loss, `stats` the accumulated DispatchStats,
    `calls` the number of calls and `expert_rows` the last call's rows per
    logical expert (what a Rebalancer observes).
    """

    def __init__(self, config: MoEConfig, *, mesh: jax.sharding.Mesh | None = None,
                 rngs: nnx.Rngs, placement: Placement | None = None,
                 replica_choice: str = "local"):
        self.config = config
        self.mesh = mesh
        self.replica_choice = replica_choice
        hidden, ffn, experts = config.hidden_size, config.ffn_size, config.num_experts
        dtype = config.param_dtype
        axis = expert_axis_or_none(config)
        self.router = nnx.Param(router_init(rngs.params(), (hidden, experts), dtype))
        self.router_bias = (nnx.Param(jnp.zeros((experts,), dtype))
                            if config.router == "sigmoid_grouped" else None)
        sharding = {} if mesh is None else dict(out_sharding=(axis, None, None), mesh=mesh)
        arrays = None if placement is None else placement.device_arrays()
        slots = experts if arrays is None else arrays.num_slots
        sharded = lambda init, shape: nnx.Param(  # noqa: E731
            on_slots(init, arrays)(rngs.params(), shape, dtype), **sharding)
        self.w_gate_up = sharded(gate_up_init, (slots, hidden, 2 * ffn))
        self.w_down = sharded(expert_init, (slots, ffn, hidden))
        self.placement = None if arrays is None else MoEPlacement(arrays)
        self.expert_rows = MoEStats(jnp.zeros((experts,), jnp.int32))
        self.stats = MoEStats(DispatchStats.zeros())
        self.calls = MoEStats(jnp.zeros((), jnp.int32))
        self.aux_loss = MoEAuxLoss(jnp.zeros((), jnp.float32))

    def params(self) -> MoEParams:
        bias = None if self.router_bias is None else self.router_bias[...]
        return MoEParams(self.router[...], bias,
                         ExpertWeights(self.w_gate_up[...], self.w_down[...]))

    def set_placement(self, placement: Placement) -> None:
        """Routes by `placement` from the next call (move the weights to it
        first: moe_jax.rebalance.move_slots)."""
        if self.placement is None:
            raise ValueError("placement: this module was built without one")
        self.placement.set_value(placement.device_arrays())

    def __call__(self, x: jax.Array) -> jax.Array:
        placement = None if self.placement is None else self.placement.get_value()
        y, aux = moe_layer(self.params(), x, self.config, self.mesh, placement=placement,
                           replica_choice=self.replica_choice)
        self.aux_loss[...] = aux.weighted_loss(self.config)
        self.expert_rows[...] = aux.expert_rows
        self.stats.set_value(self.stats.get_value() + aux.stats)
        self.calls[...] = self.calls[...] + 1
        return y

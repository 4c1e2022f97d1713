"""Flax nnx MoE module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import MoEConfig
from moe_jax.dispatch import DispatchStats
from moe_jax.experts import ExpertWeights
from moe_jax.layer import MoEParams, moe_layer
from moe_jax.nn.init import expert_axis_or_none, expert_init, gate_up_init, router_init


class MoEStats(nnx.Variable):
    """Dispatch counters accumulated over calls (not trained)."""


class MoEAuxLoss(nnx.Variable):
    """The weighted auxiliary loss of the last call."""


class MoE(nnx.Module):
    """Router + dispatch strategy + stacked SwiGLU experts (nnx).

    Args:
      config: MoEConfig (validated when built).
      mesh: mesh holding config.expert_axis (not needed for "dense").
      rngs: nnx.Rngs for parameter initialization.

    Call: x [..., H] -> [..., H] in config.dtype. After a call, `aux_loss`
    holds the weighted auxiliary loss, `stats` the accumulated DispatchStats
    and `calls` the number of calls.
    """

    def __init__(self, config: MoEConfig, *, mesh: jax.sharding.Mesh | None = None,
                 rngs: nnx.Rngs):
        self.config = config
        self.mesh = mesh
        hidden, ffn, experts = config.hidden_size, config.ffn_size, config.num_experts
        dtype = config.param_dtype
        axis = expert_axis_or_none(config)
        self.router = nnx.Param(router_init(rngs.params(), (hidden, experts), dtype))
        self.router_bias = (nnx.Param(jnp.zeros((experts,), dtype))
                            if config.router == "sigmoid_grouped" else None)
        sharding = {} if mesh is None else dict(out_sharding=(axis, None, None), mesh=mesh)
        sharded = lambda shape: nnx.Param(expert_init(rngs.params(), shape, dtype), **sharding)
        self.w_gate_up = nnx.Param(gate_up_init(rngs.params(), (experts, hidden, 2 * ffn), dtype),
                                   **sharding)
        self.w_down = sharded((experts, ffn, hidden))
        self.stats = MoEStats(DispatchStats.zeros())
        self.calls = MoEStats(jnp.zeros((), jnp.int32))
        self.aux_loss = MoEAuxLoss(jnp.zeros((), jnp.float32))

    def params(self) -> MoEParams:
        bias = None if self.router_bias is None else self.router_bias[...]
        return MoEParams(self.router[...], bias,
                         ExpertWeights(self.w_gate_up[...], self.w_down[...]))

    def __call__(self, x: jax.Array) -> jax.Array:
        y, aux = moe_layer(self.params(), x, self.config, self.mesh)
        self.aux_loss[...] = aux.weighted_loss(self.config)
        self.stats.set_value(self.stats.get_value() + aux.stats)
        self.calls[...] = self.calls[...] + 1
        return y

"""Flax linen MoE module."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.config import MoEConfig
from moe_jax.dispatch import DispatchStats
from moe_jax.experts import ExpertWeights
from moe_jax.layer import MoEParams, moe_layer
from moe_jax.nn.init import expert_axis_or_none, expert_init, gate_up_init, router_init


class MoE(nn.Module):
    """Router + dispatch strategy + stacked SwiGLU experts.

    Attributes:
      config: MoEConfig (validated when built).
      mesh: mesh holding config.expert_axis (not needed for "dense").

    Call: x [..., H] -> [..., H] in config.dtype. Parameters: "router" [H, E],
    "w_gate_up" [E, H, 2F] (gate and up fused, see ExpertWeights), "w_down"
    [E, F, H] (partitioned over the expert axis), "router_bias" [E] for the sigmoid router. Sows the weighted
    auxiliary loss into the "losses" collection as "moe_aux_loss", and when
    the "moe_stats" collection is mutable accumulates DispatchStats
    ("dispatch") and the number of calls ("calls").
    """

    config: MoEConfig
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        hidden, ffn, experts = cfg.hidden_size, cfg.ffn_size, cfg.num_experts
        axis = expert_axis_or_none(cfg)
        part = lambda init: nn.with_partitioning(init, (axis, None, None))
        router = self.param("router", router_init, (hidden, experts), cfg.param_dtype)
        bias = None
        if cfg.router == "sigmoid_grouped":
            bias = self.param("router_bias", nn.initializers.zeros, (experts,), cfg.param_dtype)
        weights = ExpertWeights(
            self.param("w_gate_up", part(gate_up_init), (experts, hidden, 2 * ffn),
                       cfg.param_dtype),
            self.param("w_down", part(expert_init), (experts, ffn, hidden), cfg.param_dtype))
        y, aux = moe_layer(MoEParams(router, bias, weights), x, cfg, self.mesh)
        self.sow("losses", "moe_aux_loss", aux.weighted_loss(cfg))
        if self.is_mutable_collection("moe_stats") and not self.is_initializing():
            stats = self.variable("moe_stats", "dispatch", DispatchStats.zeros)
            calls = self.variable("moe_stats", "calls", lambda: jnp.zeros((), jnp.int32))
            stats.value = stats.value + aux.stats
            calls.value = calls.value + 1
        return y

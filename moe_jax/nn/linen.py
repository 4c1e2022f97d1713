"""Flax linen MoE module."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.config import MoEConfig
from moe_jax.dispatch import DispatchStats
from moe_jax.experts import ExpertWeights
from moe_jax.layer import MoEParams, moe_layer
from moe_jax.nn.init import (expert_axis_or_none, expert_init, gate_up_init, on_slots,
                             router_init)
from moe_jax.replication import PlacementArrays


class MoE(nn.Module):
    """Router + dispatch strategy + stacked SwiGLU experts.

    Attributes:
      config: MoEConfig (validated when built).
      mesh: mesh holding config.expert_axis (not needed for "dense").
      replica_choice: "local" or "balanced" (see moe_layer), with a placement.

    Call: x [..., H], placement=None -> [..., H] in config.dtype. Parameters:
    "router" [H, E], "w_gate_up" [E, H, 2F] (gate and up fused, see
    ExpertWeights), "w_down" [E, F, H] (partitioned over the expert axis),
    "router_bias" [E] for the sigmoid router. With a `placement`
    (`Placement.device_arrays()`, hot-expert replication; the same one at
    init) the expert weights are [P * S, ...], one per slot, every copy of
    an expert initialized alike (see moe_layer). Sows the weighted
    auxiliary loss into the "losses" collection as "moe_aux_loss", and when
    the "moe_stats" collection is mutable accumulates DispatchStats
    ("dispatch") and the number of calls ("calls"); when "moe_load" is
    mutable, "expert_rows" holds the last call's rows per logical expert
    (what a moe_jax.rebalance.Rebalancer observes).
    """

    config: MoEConfig
    mesh: jax.sharding.Mesh | None = None
    replica_choice: str = "local"

    @nn.compact
    def __call__(self, x: jax.Array, placement: PlacementArrays | None = None) -> jax.Array:
        cfg = self.config
        hidden, ffn, experts = cfg.hidden_size, cfg.ffn_size, cfg.num_experts
        axis = expert_axis_or_none(cfg)
        part = lambda init: nn.with_partitioning(on_slots(init, placement), (axis, None, None))
        slots = experts if placement is None else placement.num_slots
        router = self.param("router", router_init, (hidden, experts), cfg.param_dtype)
        bias = None
        if cfg.router == "sigmoid_grouped":
            bias = self.param("router_bias", nn.initializers.zeros, (experts,), cfg.param_dtype)
        weights = ExpertWeights(
            self.param("w_gate_up", part(gate_up_init), (slots, hidden, 2 * ffn),
                       cfg.param_dtype),
            self.param("w_down", part(expert_init), (slots, ffn, hidden), cfg.param_dtype))
        y, aux = moe_layer(MoEParams(router, bias, weights), x, cfg, self.mesh,
                           placement=placement, replica_choice=self.replica_choice)
        self.sow("losses", "moe_aux_loss", aux.weighted_loss(cfg))
        if self.is_mutable_collection("moe_stats") and not self.is_initializing():
            stats = self.variable("moe_stats", "dispatch", DispatchStats.zeros)
            calls = self.variable("moe_stats", "calls", lambda: jnp.zeros((), jnp.int32))
            stats.value = stats.value + aux.stats
            calls.value = calls.value + 1
        if self.is_mutable_collection("moe_load") and not self.is_initializing():
            rows = self.variable("moe_load", "expert_rows",
                                 lambda: jnp.zeros((cfg.num_experts,), jnp.int32))
            rows.value = aux.expert_rows
        return y

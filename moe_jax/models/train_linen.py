"""One optax training step of the linen decoder (MixtralLinen).

The train state is a plain pytree, {"params": canonical params, "opt_state":
the optax state, "step": int32}, which `moe_jax.checkpoint.save_state`
writes and `restore_state` reads back onto any expert-parallel size.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from moe_jax.dispatch import DispatchStats
from moe_jax.models.decoder import (DecoderConfig, MixtralLinen, init_cache, init_params,
                                    linen_stats)
from moe_jax.models.sharding import replicate, shard_params
from moe_jax.models.train_task import full_sequence_inputs, lm_loss


class StepMetrics(NamedTuple):
    """loss = cross_entropy + aux_loss (float32 scalars); stats: DispatchStats
    summed over the layers."""

    loss: jax.Array
    cross_entropy: jax.Array
    aux_loss: jax.Array
    stats: DispatchStats


def init_state(params: dict, optimizer: optax.GradientTransformation,
               mesh: jax.sharding.Mesh | None, cfg: DecoderConfig) -> dict:
    """The train state of canonical `params`, laid out on `mesh` (expert
    weights split over the expert axis, the optimizer's moments likewise).
    The state owns copies (make_step donates it), so `params` stays valid."""
    params = jax.tree.map(lambda a: a.copy(), shard_params(params, mesh, cfg.moe.expert_axis))
    opt_state = jax.jit(optimizer.init)(params)
    return dict(params=params, opt_state=opt_state,
                step=replicate(jnp.zeros((), jnp.int32), mesh))


def make_step(cfg: DecoderConfig, mesh: jax.sharding.Mesh | None,
              optimizer: optax.GradientTransformation):
    """A jitted step(state, inputs, targets) -> (state, StepMetrics).

    inputs, targets: [B, S] int32 with S = cfg.max_len and B * S tokens
    splitting evenly over the mesh's token axes. The loss adds the MoE
    layers' weighted auxiliary losses (sown into "losses").
    """
    model = MixtralLinen(cfg, mesh)

    def loss_fn(params, inputs, targets):
        positions, index, kv_valid = full_sequence_inputs(cfg, inputs)
        cache = init_cache(cfg, inputs.shape[0])
        out, state = model.apply({"params": params}, inputs, positions, cache, index,
                                 kv_valid, mutable=["losses", "moe_stats"])
        cross_entropy = lm_loss(out.logits, targets, mesh)
        aux = sum(jax.tree.leaves(state["losses"]), jnp.float32(0))
        return cross_entropy + aux, (cross_entropy, aux, linen_stats(state, cfg))

    def step(state: dict, inputs, targets):
        (loss, (ce, aux, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], inputs, targets)
        # Not fused into the update: its arithmetic (contractions included)
        # is then the same whatever program computed the gradients.
        grads = jax.lax.optimization_barrier(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new = dict(params=params, opt_state=opt_state, step=state["step"] + 1)
        return new, StepMetrics(loss, ce, aux, stats)

    return jax.jit(step, donate_argnums=0)


def abstract_state(cfg: DecoderConfig, optimizer: optax.GradientTransformation) -> Any:
    """ShapeDtypeStructs of the train state (no shardings; see
    moe_jax.checkpoint.restore_state)."""
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
    return dict(params=params, opt_state=jax.eval_shape(optimizer.init, params),
                step=jax.ShapeDtypeStruct((), jnp.int32))

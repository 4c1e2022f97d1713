"""One optax training step of the nnx decoder (MixtralNnx, nnx.Optimizer).

The model and optimizer are nnx objects updated in place; `state_tree`
and `load_state_tree` turn their trainable state into a plain pytree
({"model": the model's nnx.Param values, "optimizer": the optimizer's
state}, nested dicts) that `moe_jax.checkpoint.save_state` writes and
`restore_state` reads back onto any expert-parallel size.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moe_jax.models.decoder import DecoderConfig, MixtralNnx, init_cache, nnx_load_params
from moe_jax.models.train_linen import StepMetrics
from moe_jax.models.train_task import full_sequence_inputs, lm_loss


def build(cfg: DecoderConfig, mesh: jax.sharding.Mesh | None,
          optimizer: optax.GradientTransformation, params: dict | None = None):
    """(model, nnx.Optimizer) on `mesh`, with canonical `params` loaded if given."""
    model = MixtralNnx(cfg, mesh=mesh, rngs=nnx.Rngs(0))
    if params is not None:
        nnx_load_params(model, params)
    return model, nnx.Optimizer(model, optimizer, wrt=nnx.Param)


def make_step(cfg: DecoderConfig, mesh: jax.sharding.Mesh | None = None):
    """An nnx.jit step(model, optimizer, inputs, targets) -> StepMetrics that
    updates model and optimizer in place (inputs as in train_linen.make_step;
    mesh: the model's, for the loss's reduction order, see lm_loss)."""

    def loss_fn(model: MixtralNnx, inputs, targets):
        positions, index, kv_valid = full_sequence_inputs(cfg, inputs)
        out = model(inputs, positions, init_cache(cfg, inputs.shape[0]), index, kv_valid)
        cross_entropy = lm_loss(out.logits, targets, mesh)
        aux = sum((block.moe.aux_loss[...] for block in model.layers), jnp.float32(0))
        return cross_entropy + aux, (cross_entropy, aux, out.stats)

    @nnx.jit
    def step(model: MixtralNnx, optimizer: nnx.Optimizer, inputs, targets):
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, (ce, aux, stats)), grads = grad_fn(model, inputs, targets)
        grads = jax.lax.optimization_barrier(grads)
        optimizer.update(model, grads)
        return StepMetrics(loss, ce, aux, stats)

    return step


def state_tree(model: MixtralNnx, optimizer: nnx.Optimizer) -> dict:
    """The trainable state as nested dicts of arrays."""
    return dict(model=nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                optimizer=nnx.to_pure_dict(nnx.state(optimizer)))


def load_state_tree(model: MixtralNnx, optimizer: nnx.Optimizer, tree: dict) -> None:
    """Puts a state_tree (e.g. restored onto another mesh) into model and optimizer."""
    params = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(params, tree["model"])
    nnx.update(model, params)
    opt = nnx.state(optimizer)
    nnx.replace_by_pure_dict(opt, tree["optimizer"])
    nnx.update(optimizer, opt)


def abstract_state(cfg: DecoderConfig, optimizer: optax.GradientTransformation) -> Any:
    """ShapeDtypeStructs of state_tree (no shardings)."""
    def make():
        return state_tree(*build(cfg, None, optimizer))
    return jax.eval_shape(make)

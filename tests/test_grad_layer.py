"""jax.grad through the MoE layer and its Flax modules (CPU, 8 devices).

Every strategy and transport, on 1-D and data x expert meshes, against
dense's gradients (XLA's expert matmul: the experts' and the router's
weight gradients are sums over tokens split over ranks, so they agree
within GRAD_RTOL, not bitwise); finite differences on a small float32
layer; the linen and nnx modules against the function.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.test_util import check_grads

import moe_jax as mj
from moe_jax.layer import MoEParams, init_moe_params, moe_layer
from moe_jax.nn import linen as moe_linen, nnx as moe_nnx
from moe_testing import GRAD_MATMULS, bits, mesh_of, rel_error

GRAD_RTOL = 2e-5
CONFIG = mj.MoEConfig(hidden_size=16, ffn_size=24, num_experts=8, top_k=3,
                      strategy="cap_and_spill", capacity=2, spill_capacity=1,
                      dtype=jnp.float32, load_balance_coef=0.5, router_z_coef=0.1)


def _loss(config, mesh, ct):
    def loss(params, x):
        y, aux = moe_layer(params, x, config, mesh)
        return jnp.sum(y.astype(jnp.float32) * ct) + aux.weighted_loss(config)
    return loss


def _grads(config, mesh, params, x, seed=0):
    ct = jax.random.normal(jax.random.key(seed), x.shape, jnp.float32)
    return jax.jit(jax.value_and_grad(_loss(config, mesh, ct), argnums=(0, 1)))(params, x)


def _assert_close(got, want, rtol, what):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_error(g, w) < rtol, f"{what}: {rel_error(g, w)}"


@pytest.mark.parametrize("matmul", GRAD_MATMULS)
@pytest.mark.parametrize("strategy, transport", [
    ("max_counts", "lax"), ("max_counts", "custom_call"), ("cap_and_spill", "lax"),
    ("cap_and_spill", "custom_call"), ("ragged", "lax"), ("ragged", "custom_call")])
def test_every_strategy_and_transport_has_dense_gradients(strategy, transport, matmul):
    config = CONFIG.replace(strategy=strategy, transport=transport, matmul=matmul)
    params = init_moe_params(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (4, 16, config.hidden_size))
    (loss, grads) = _grads(config, mesh_of(8), params, x)
    (want_loss, want) = _grads(config.replace(strategy="dense"), None, params, x)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    _assert_close(grads, want, GRAD_RTOL, f"{strategy}/{transport}")
    assert float(jnp.abs(grads[0].router).max()) > 0


@pytest.mark.parametrize("strategy", ["max_counts", "cap_and_spill", "ragged"])
def test_transports_give_the_same_layer_gradient_bits(strategy):
    config = CONFIG.replace(strategy=strategy)
    params = init_moe_params(jax.random.key(2), config)
    x = jax.random.normal(jax.random.key(3), (64, config.hidden_size))
    runs = [_grads(config.replace(transport=t), mesh_of(4), params, x)[1]
            for t in ("lax", "custom_call")]
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        np.testing.assert_array_equal(bits(np.asarray(a)), bits(np.asarray(b)))


@pytest.mark.parametrize("mesh_shape, names, data_axes, strategy, transport", [
    ((2, 4), ("data", "ep"), ("data",), "cap_and_spill", "custom_call"),
    ((4, 2), ("data", "ep"), ("data",), "ragged", "custom_call"),
    ((2, 4), ("data", "ep"), ("data",), "max_counts", "lax"),
    ((2, 2, 2), ("pod", "data", "ep"), ("pod", "data"), "cap_and_spill", "lax"),
])
def test_gradients_under_data_axes(mesh_shape, names, data_axes, strategy, transport):
    """Experts are replicated over the data axes: their gradient sums every
    group's; the router's sums every token's."""
    config = CONFIG.replace(strategy=strategy, transport=transport, data_axes=data_axes)
    mesh = jax.make_mesh(mesh_shape, names, devices=jax.devices("cpu")[:8],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    params = init_moe_params(jax.random.key(4), config)
    x = jax.random.normal(jax.random.key(5), (4, 16, config.hidden_size))
    loss, grads = _grads(config, mesh, params, x)
    want_loss, want = _grads(config.replace(strategy="dense", data_axes=()), None, params, x)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    _assert_close(grads, want, GRAD_RTOL, f"{names} {strategy}/{transport}")


@pytest.mark.parametrize("strategy", ["dense", "cap_and_spill"])
def test_default_config_trains_in_bfloat16(strategy):
    """jax.grad with the default configuration (bfloat16, custom-call pack
    and combine): dense un-jitted, cap-and-spill jitted, both close to the
    float32 gradients."""
    config = mj.MoEConfig(hidden_size=32, ffn_size=48, num_experts=8, capacity=1,
                          spill_capacity=1, strategy=strategy)
    params = init_moe_params(jax.random.key(6), config)
    x = jax.random.normal(jax.random.key(7), (16, config.hidden_size))
    ct = jax.random.normal(jax.random.key(8), x.shape)
    if strategy == "dense":
        grads = jax.grad(_loss(config, None, ct))(params, x)
    else:
        grads = jax.jit(jax.grad(_loss(config, mesh_of(4), ct)))(params, x)
    want = jax.jit(jax.grad(_loss(config.replace(strategy="dense", dtype=jnp.float32), None,
                                  ct)))(params, x)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and np.isfinite(np.asarray(g)).all()
        assert rel_error(g, w) < 2e-2


def _margin(config, params, x):
    """Smallest gap between a token's k-th and (k+1)-th router logit."""
    logits = np.asarray(x.reshape(-1, x.shape[-1]) @ params.router)
    top = -np.sort(-logits, axis=1)
    return float((top[:, config.top_k - 1] - top[:, config.top_k]).min())


@pytest.mark.parametrize("strategy", ["cap_and_spill", "ragged"])
def test_gradients_pass_finite_differences(strategy):
    """Float32 layer, fallback forced (C = S = 1); the finite-difference
    steps stay far below the routing margin, so no pick changes."""
    config = CONFIG.replace(strategy=strategy, capacity=1, spill_capacity=1, top_k=2,
                            transport="custom_call")
    params = init_moe_params(jax.random.key(1), config)
    params = params._replace(router=params.router * 4)     # well separated logits
    x = jax.random.normal(jax.random.key(101), (12, config.hidden_size))
    eps = 1e-3
    assert _margin(config, params, x) > 300 * eps
    ct = jax.random.normal(jax.random.key(11), x.shape)
    loss = jax.jit(_loss(config, mesh_of(4), ct))
    check_grads(loss, (params, x), order=1, modes=("rev",), eps=eps, atol=5e-2, rtol=5e-2)


def test_auxiliary_losses_have_dense_gradients():
    """The load-balancing and z-losses alone: their router gradient (psum
    over the ranks' tokens) equals dense's."""
    config = CONFIG.replace(strategy="ragged", load_balance_coef=1.0, router_z_coef=1.0)
    params = init_moe_params(jax.random.key(12), config)
    x = jax.random.normal(jax.random.key(13), (64, config.hidden_size))

    def aux_loss(config, mesh):
        return lambda p, x: moe_layer(p, x, config, mesh)[1].weighted_loss(config)

    got = jax.jit(jax.grad(aux_loss(config, mesh_of(8)), argnums=(0, 1)))(params, x)
    want = jax.jit(jax.grad(aux_loss(config.replace(strategy="dense"), None),
                            argnums=(0, 1)))(params, x)
    _assert_close(got, want, GRAD_RTOL, "aux losses")
    assert not np.asarray(got[0].experts.w_gate_up).any(), "aux losses do not touch experts"
    assert np.abs(np.asarray(got[0].router)).max() > 0


def _linen_params(variables) -> MoEParams:
    p = variables["params"]
    return MoEParams(p["router"], None, mj.ExpertWeights(
        p["w_gate_up"].unbox(), p["w_down"].unbox()))


def test_linen_module_gradients_equal_the_function():
    mesh = mesh_of(4)
    module = moe_linen.MoE(CONFIG, mesh)
    x = jax.random.normal(jax.random.key(14), (4, 8, CONFIG.hidden_size))
    ct = jax.random.normal(jax.random.key(15), x.shape)
    variables = jax.jit(module.init)(jax.random.key(16), x)

    def loss(params, x):
        y, state = module.apply({"params": params}, x, mutable=["losses", "moe_stats"])
        aux = sum(jax.tree.leaves(state["losses"]))
        return jnp.sum(y * ct) + aux, state["moe_stats"]["calls"]

    (value, calls), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        variables["params"], x)
    assert int(calls) == 1
    want_value, want = jax.jit(jax.value_and_grad(_loss(CONFIG, mesh, ct), argnums=(0, 1)))(
        _linen_params(variables), x)
    np.testing.assert_array_equal(np.float32(value), np.float32(want_value))
    got = (_linen_params({"params": grads[0]}), grads[1])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(bits(np.asarray(a)), bits(np.asarray(b)))


def test_nnx_module_trains_with_optax():
    mesh = mesh_of(4)
    model = moe_nnx.MoE(CONFIG, mesh=mesh, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(17), (32, CONFIG.hidden_size))
    ct = jax.random.normal(jax.random.key(18), x.shape)
    params = model.params()
    want_value, want = jax.jit(jax.value_and_grad(_loss(CONFIG, mesh, ct)))(params, x)

    def loss(model):
        return jnp.sum(model(x) * ct) + model.aux_loss[...]

    value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
    np.testing.assert_array_equal(np.float32(value), np.float32(want_value))
    got = MoEParams(grads.router[...], None, mj.ExpertWeights(
        grads.w_gate_up[...], grads.w_down[...]))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(bits(np.asarray(a)), bits(np.asarray(b)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    first = float(step(model, optimizer))
    for _ in range(3):
        last = float(step(model, optimizer))
    assert last < first

"""Routers and auxiliary losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from moe_jax import routing
from moe_testing import bits
from moe_jax.routing import (load_balancing_loss, router_z_loss, sigmoid_grouped,
                             topk_softmax)


def test_topk_softmax_weights_and_ties():
    logits = jnp.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    r = topk_softmax(logits, 2)
    np.testing.assert_array_equal(np.asarray(r.expert_ids), [[1, 2], [0, 1]])
    np.testing.assert_allclose(np.asarray(r.weights).sum(1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(r.weights)[1], [0.5, 0.5])


def test_topk_softmax_matches_numpy():
    logits = jax.random.normal(jax.random.key(0), (64, 8))
    r = topk_softmax(logits, 2)
    probs = np.exp(np.asarray(logits, np.float64))
    probs /= probs.sum(1, keepdims=True)
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :2]
    np.testing.assert_array_equal(np.asarray(r.expert_ids), ids)
    top = np.take_along_axis(probs, ids, 1)
    np.testing.assert_allclose(np.asarray(r.weights), top / top.sum(1, keepdims=True), rtol=1e-5)


def test_balanced_load_balancing_loss_is_one():
    logits = jnp.zeros((8, 4)).at[jnp.arange(8), jnp.arange(8) % 4].set(5.0)
    r = topk_softmax(logits, 1)
    np.testing.assert_allclose(float(load_balancing_loss(r, 4)), 1.0, rtol=1e-5)
    skewed = topk_softmax(jnp.zeros((8, 4)).at[:, 0].set(5.0), 1)
    assert float(load_balancing_loss(skewed, 4)) > 3.0


def test_router_z_loss():
    logits = jax.random.normal(jax.random.key(1), (16, 8))
    r = topk_softmax(logits, 2)
    z = np.log(np.exp(np.asarray(logits, np.float64)).sum(1))
    np.testing.assert_allclose(float(router_z_loss(r)), np.mean(z * z), rtol=1e-5)


def test_sigmoid_grouped_picks_only_from_kept_groups():
    logits = jax.random.normal(jax.random.key(2), (32, 16))
    r = sigmoid_grouped(logits, top_k=4, num_groups=4, topk_groups=2)
    groups = np.asarray(r.expert_ids) // 4
    assert all(len(set(g)) <= 2 for g in groups)
    ids = np.asarray(r.expert_ids)
    assert all(len(set(row)) == 4 for row in ids)
    np.testing.assert_allclose(np.asarray(r.weights).sum(1), 1.0, rtol=1e-5)


def test_softmax_and_renormalize_match_jax_and_their_gradients_check():
    logits = jax.random.normal(jax.random.key(0), (64, 16), jnp.float32) * 2.0
    np.testing.assert_allclose(routing.softmax(logits), jax.nn.softmax(logits), rtol=1e-6)
    picked = jax.random.uniform(jax.random.key(1), (64, 4), jnp.float32) + 0.1
    np.testing.assert_allclose(routing.renormalize(picked),
                               picked / jnp.sum(picked, axis=-1, keepdims=True), rtol=1e-6)
    check_grads(routing.softmax, (logits,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)
    check_grads(routing.renormalize, (picked,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


def test_a_tokens_routing_and_its_gradient_depend_on_that_token_alone():
    """Same bits for a token alone and among others (fixed-order sums)."""
    logits = jax.random.normal(jax.random.key(2), (33, 8), jnp.float32)
    cot = jax.random.normal(jax.random.key(3), (33, 8), jnp.float32)

    def probs_and_grad(fn, rows):
        out, pull = jax.vjp(fn, logits[rows])
        return np.asarray(out), np.asarray(pull(cot[rows])[0])

    for fn in (routing.softmax, lambda v: routing.renormalize(jnp.abs(v) + 0.1)):
        whole = probs_and_grad(jax.jit(fn), slice(None))
        alone = probs_and_grad(jax.jit(fn), slice(5, 6))
        for a, b in zip(whole, alone):
            np.testing.assert_array_equal(bits(a[5:6]), bits(b))


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_fixed_order_routing_picks_the_same_experts_and_weights(router):
    logits = jax.random.normal(jax.random.key(4), (64, 16), jnp.float32)
    if router == "softmax":
        plain, fixed = (topk_softmax(logits, 4, fixed_order=f) for f in (False, True))
    else:
        plain, fixed = (sigmoid_grouped(logits, 4, 4, 2, fixed_order=f) for f in (False, True))
    np.testing.assert_array_equal(np.asarray(plain.expert_ids), np.asarray(fixed.expert_ids))
    np.testing.assert_allclose(np.asarray(fixed.weights), np.asarray(plain.weights), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(fixed.probs), np.asarray(plain.probs), rtol=1e-6)

"""Weight gradients summed in one order (moe_jax.ordered_grads): with the
row-invariant matmul every strategy's gradients are dense's, bit for bit,
at any top-k, with the cap-and-spill fallback, on 2 to 8 ranks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.test_util import check_grads

import moe_jax as mj
from moe_jax.ordered_grads import (SourceSizes, ordered_matmul, ordered_sum, replicate_for_ranks,
                                   source_weight_grads)
from moe_testing import bits, mesh_of


def test_ordered_sum_adds_left_to_right():
    parts = jnp.asarray([[1e8], [1.0], [-1e8], [1.0]], jnp.float32)
    want = ((np.float32(1e8) + np.float32(1.0)) + np.float32(-1e8)) + np.float32(1.0)
    assert float(ordered_sum(parts, 0)[0]) == float(want) == 1.0


def _groups(rng, sizes, k, n):
    a = rng.standard_normal((sum(sizes), k)).astype(np.float32)
    d = rng.standard_normal((sum(sizes), n)).astype(np.float32)
    return a, d


def test_source_weight_grads_are_each_groups_product():
    rng = np.random.default_rng(0)
    sizes = np.asarray([[3, 0], [5, 2], [0, 0]], np.int32)
    a, d = _groups(rng, sizes.reshape(-1).tolist(), 6, 4)
    got = np.asarray(source_weight_grads(jnp.asarray(a), jnp.asarray(d),
                                         SourceSizes(jnp.asarray(sizes), 5)))
    start = 0
    for e in range(3):
        for s in range(2):
            n = sizes[e, s]
            want = a[start:start + n].T.astype(np.float64) @ d[start:start + n]
            np.testing.assert_allclose(got[e, s], want, rtol=1e-5, atol=1e-5)
            start += n


def test_a_partial_depends_on_its_group_alone():
    """The same group's rows give the same bits at any offset, next to any
    other groups, with any padding after them and any bound on the rows."""
    rng = np.random.default_rng(1)
    a, d = _groups(rng, [7], 16, 8)

    def partial(before, after, max_rows, pad):
        other_a, other_d = _groups(rng, [before + after], 16, 8)
        rows_a = np.concatenate([other_a[:before], a, other_a[before:],
                                 rng.standard_normal((pad, 16)).astype(np.float32)])
        rows_d = np.concatenate([other_d[:before], d, other_d[before:],
                                 rng.standard_normal((pad, 8)).astype(np.float32)])
        sizes = jnp.asarray([[before, 7, after]], jnp.int32)
        return np.asarray(source_weight_grads(jnp.asarray(rows_a), jnp.asarray(rows_d),
                                              SourceSizes(sizes, max_rows)))[0, 1]

    first = partial(0, 0, 7, 0)
    for before, after, max_rows, pad in [(5, 3, 9, 4), (11, 0, 40, 1), (1, 20, 20, 0)]:
        np.testing.assert_array_equal(bits(partial(before, after, max_rows, pad)), bits(first))


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=2, max_size=6), st.integers(0, 5),
       st.integers(0, 3))
def test_partials_are_independent_of_the_other_groups(sizes, pick, pad):
    """Property: each group's partial has the bits it has alone, whatever
    the other groups' sizes, the padding after the rows and the row bound."""
    pick %= len(sizes)
    rng = np.random.default_rng(sum(sizes) * 7 + pick)
    a, d = _groups(rng, [sum(sizes) + pad], 8, 4)
    grouped = jnp.asarray(sizes, jnp.int32).reshape(len(sizes), 1)
    got = np.asarray(source_weight_grads(jnp.asarray(a), jnp.asarray(d),
                                         SourceSizes(grouped, max(sizes) + pad)))
    start = sum(sizes[:pick])
    alone = np.asarray(source_weight_grads(
        jnp.asarray(a[start:start + sizes[pick]]), jnp.asarray(d[start:start + sizes[pick]]),
        SourceSizes(jnp.asarray([[sizes[pick]]], jnp.int32), max(sizes[pick], 1))))
    np.testing.assert_array_equal(bits(got[pick, 0]), bits(alone[0, 0]))


def test_replicate_for_ranks_gradient_is_the_ordered_sum():
    w = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3)), jnp.float32)
    cot = jnp.asarray(np.random.default_rng(3).standard_normal((8, 3)) * 1e6, jnp.float32)
    _, pull = jax.vjp(lambda v: replicate_for_ranks(v, 4), w)
    (got,) = pull(cot)
    np.testing.assert_array_equal(bits(np.asarray(got)),
                                  bits(np.asarray(ordered_sum(cot.reshape(4, 2, 3), 0))))


def _grads(config, params, x, mesh):
    def loss(p, x):
        y, aux = mj.moe_layer(p, x, config, mesh)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))) + aux.weighted_loss(config)
    return jax.tree.map(np.asarray, jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x))


CASES = [(8, 1, jnp.float32, False), (8, 3, jnp.float32, False), (8, 4, jnp.bfloat16, False),
         (4, 8, jnp.float32, False), (2, 3, jnp.bfloat16, False), (4, 2, jnp.float32, True)]


def check_every_strategy(ranks, top_k, dtype, backend="cpu", transport="lax",
                         strategies=("max_counts", "ragged", "cap_and_spill"), hot=False):
    """Every strategy's gradients (parameters and tokens) have dense's bits
    over the same mesh, cap_and_spill with and without its fallback; with
    hot, a router that sends most tokens to expert 0 first."""
    config = mj.MoEConfig(hidden_size=32, ffn_size=48, num_experts=8, top_k=top_k,
                          strategy="dense", dtype=dtype, param_dtype=jnp.float32,
                          matmul="row_invariant", load_balance_coef=0.01, router_z_coef=0.001)
    key = jax.random.key(ranks * 10 + top_k)
    params = mj.init_moe_params(key, config)
    if hot:
        params = params._replace(router=params.router.at[:, 0].add(2.0))
    x = jax.random.normal(jax.random.fold_in(key, 1), (ranks * 16, 32), dtype)
    mesh = mesh_of(ranks, backend)
    want = _grads(config, params, x, mesh)
    configs = [config.replace(strategy=s, transport=transport) for s in strategies
               if s != "cap_and_spill"]
    if "cap_and_spill" in strategies:
        spill = config.replace(strategy="cap_and_spill", capacity=2, spill_capacity=1,
                               transport=transport)
        _, aux = jax.jit(lambda p, x: mj.moe_layer(p, x, spill, mesh))(params, x)
        if ranks > 1 and transport != "nvlink":
            assert int(aux.stats.fallback_steps) > 0, "C and S must force the fallback"
        configs += [spill, spill.replace(capacity=64, spill_capacity=8)]
    for cfg in configs:
        got = _grads(cfg, params, x, mesh)
        for path, g, w in zip(jax.tree_util.tree_leaves_with_path(want),
                              jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(
                bits(g), bits(w), err_msg=f"{cfg.strategy} C={cfg.capacity} "
                f"{jax.tree_util.keystr(path[0])}")


@pytest.mark.parametrize("ranks, top_k, dtype, hot", CASES)
def test_every_strategy_has_denses_gradient_bits(ranks, top_k, dtype, hot):
    check_every_strategy(ranks, top_k, dtype, hot=hot)


def test_dense_over_a_mesh_splits_the_tokens_and_matches_one_device():
    """dense with the expert axis runs data-parallel: the same layer output,
    losses and counts as on one device (XLA's matmul: within rounding)."""
    config = mj.MoEConfig(hidden_size=32, ffn_size=48, num_experts=8, top_k=2,
                          strategy="dense", dtype=jnp.float32, param_dtype=jnp.float32)
    params = mj.init_moe_params(jax.random.key(5), config)
    x = jax.random.normal(jax.random.key(6), (64, 32), jnp.float32)
    y_mesh, aux_mesh = jax.jit(lambda p, x: mj.moe_layer(p, x, config, mesh_of(4)))(params, x)
    y_one, aux_one = jax.jit(lambda p, x: mj.moe_layer(p, x, config))(params, x)
    np.testing.assert_allclose(np.asarray(y_mesh), np.asarray(y_one), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(aux_mesh.load_balance_loss),
                               float(aux_one.load_balance_loss), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(aux_mesh.expert_rows),
                                  np.asarray(aux_one.expert_rows))


def test_ordered_matmul_is_x_at_w_with_gradients_that_check():
    x = jax.random.normal(jax.random.key(5), (24, 16), jnp.float32)
    w = jax.random.normal(jax.random.key(6), (16, 8), jnp.float32)
    np.testing.assert_allclose(ordered_matmul(x, w), x @ w, rtol=1e-5, atol=1e-5)
    cot = jax.random.normal(jax.random.key(7), (24, 8), jnp.float32)
    got = jax.vjp(ordered_matmul, x, w)[1](cot)
    want = jax.vjp(jnp.dot, x, w)[1](cot)
    for g, d in zip(got, want):
        np.testing.assert_allclose(g, d, rtol=1e-5, atol=1e-5)
    check_grads(ordered_matmul, (x, w), order=1, modes=["rev"],
                atol=1e-2, rtol=1e-2)


def test_ordered_matmul_input_gradient_rows_depend_on_their_row_alone():
    x = jax.random.normal(jax.random.key(8), (40, 16), jnp.float32)
    w = jax.random.normal(jax.random.key(9), (16, 8), jnp.float32)
    cot = jax.random.normal(jax.random.key(10), (40, 8), jnp.float32)
    whole = jax.vjp(ordered_matmul, x, w)[1](cot)[0]
    part = jax.vjp(ordered_matmul, x[7:9], w)[1](cot[7:9])[0]
    np.testing.assert_array_equal(bits(np.asarray(whole[7:9])), bits(np.asarray(part)))

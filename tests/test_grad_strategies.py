"""Gradients through dispatch_combine on every strategy, transport and
kernel implementation against `dense`'s (4 and 8 CPU devices).

With experts whose every output row is a function of its input row alone,
the forward is dense's bit for bit, and so are the gradients of the combine
weights (per-pick dots in a fixed order) and of the tokens (each a
pick-order float32 sum, over every window together when cap-and-spill falls
back: passes.tap_tokens). The experts' own parameter gradients (sums over rows, split over ranks) agree
within PARAM_RTOL. The NVLink transport's gradient rules run here on its
pure-JAX reference (moe_jax/nvlink_reference.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_jax as mj
from moe_jax import nvlink_grad
from moe_jax.fp8 import dequantize, quantize_e4m3
from moe_jax.nvlink_reference import ReferenceOps
from moe_testing import (ROUTINGS, bits, mesh_of, random_case, rel_error, rowwise_experts,
                         strategy_grads)

HIDDEN, FFN = 16, 12
PARAM_RTOL = 1e-5   # expert parameter gradients: sums over rows in another split


def _scales(num_experts, seed=5):
    return jax.random.normal(jax.random.key(seed), (num_experts, HIDDEN), jnp.float32)


def _assert_bits(got, want, what):
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)), err_msg=what)


def _check_grads_against_dense(strategy, ranks, x, ids, w, params, *, kind="rowwise",
                               **options):
    want = strategy_grads("dense", x, ids, w, params, 1, kind=kind)
    got = strategy_grads(strategy, x, ids, w, params, ranks, kind=kind, **options)
    assert got[1] == want[1], "dropped_rows differs from dense"
    for name, i in (("out", 0), ("dx", 2), ("dweights", 3)):
        if kind == "rowwise":
            _assert_bits(got[i], want[i], f"{strategy} {options}: {name} differs from dense")
        else:
            assert rel_error(got[i], want[i]) < PARAM_RTOL, f"{strategy} {options}: {name}"
    for g, d in zip(jax.tree.leaves(got[4]), jax.tree.leaves(want[4])):
        assert rel_error(g, d) < PARAM_RTOL, f"{strategy} {options}: expert parameters"
    return got


grad_case = st.fixed_dictionaries(dict(
    ranks=st.sampled_from([4, 8]),
    tokens=st.sampled_from([1, 5, 12]),
    experts_per_rank=st.sampled_from([1, 2]),
    top_k=st.sampled_from([1, 3, 4, 8]),
    kind=st.sampled_from(ROUTINGS),
    seed=st.integers(0, 2**31 - 1),
    transport=st.sampled_from(["lax", "custom_call"]),
    impl=st.sampled_from(["custom_call", "reference"]),
    strategy=st.sampled_from([("max_counts", None, None), ("ragged", None, None),
                              ("cap_and_spill", 1, 0), ("cap_and_spill", 2, 1),
                              ("cap_and_spill", 4, 4)]),
))


@settings(max_examples=10)
@given(grad_case)
def test_token_and_weight_gradients_are_dense_bits(c):
    """Tiny C and S force the spill pass and the fallback (whose backward
    runs under the same cond, with the same capacities)."""
    strategy, capacity, spill = c["strategy"]
    num_experts = c["ranks"] * c["experts_per_rank"]
    x, ids, w = random_case(c["seed"], c["ranks"], c["tokens"], num_experts,
                            min(c["top_k"], num_experts), HIDDEN, c["kind"])
    _check_grads_against_dense(strategy, c["ranks"], x, ids, w, _scales(num_experts),
                               capacity=capacity, spill=spill, transport=c["transport"],
                               impl=c["impl"])


@pytest.mark.parametrize("strategy, capacity, spill", [
    ("max_counts", None, None), ("ragged", None, None), ("cap_and_spill", 1, 1)])
@pytest.mark.parametrize("transport", ["lax", "custom_call"])
def test_swiglu_gradients_match_dense(strategy, capacity, spill, transport):
    """XLA's expert matmul (lax.ragged_dot): within float32 rounding."""
    x, ids, w = random_case(4, 4, 6, 8, 3, HIDDEN, "zipf")
    experts = mj.init_expert_weights(jax.random.key(1), 8, HIDDEN, FFN)
    _check_grads_against_dense(strategy, 4, x, ids, w, tuple(experts), kind="swiglu",
                               capacity=capacity, spill=spill, transport=transport)


def test_transports_give_the_same_gradient_bits():
    x, ids, w = random_case(8, 8, 4, 16, 3, HIDDEN, "zipf")
    experts = tuple(mj.init_expert_weights(jax.random.key(2), 16, HIDDEN, FFN))
    for strategy in ("max_counts", "cap_and_spill", "ragged"):
        runs = [strategy_grads(strategy, x, ids, w, experts, 8, capacity=1, spill=1,
                               transport=t, kind="swiglu") for t in ("lax", "custom_call")]
        for a, b in zip(jax.tree.leaves(runs[0][2:5]), jax.tree.leaves(runs[1][2:5])):
            _assert_bits(a, b, f"{strategy}: transports differ")


def _invalid_routing(seed, tokens, num_experts, top_k):
    """Random ids with duplicates within tokens, ids >= E and negative ids."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, num_experts, size=(tokens, top_k)).astype(np.int32)
    ids[rng.random((tokens, top_k)) < 0.15] = num_experts + 3
    ids[rng.random((tokens, top_k)) < 0.15] = -2
    ids[0, :] = ids[0, 0]     # one token repeats its first pick
    return ids


def _kept_sum(x, ids, w, scales, num_experts):
    """numpy: each token's kept picks, float32, in pick order."""
    out = np.zeros(x.shape, np.float32)
    for t in range(ids.shape[0]):
        seen = set()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < num_experts and e not in seen:
                seen.add(e)
                term = np.float32(w[t, j]) * (np.tanh(x[t]) * scales[e]).astype(np.float32)
                out[t] = (out[t] + term).astype(np.float32)
    return out


@pytest.mark.parametrize("strategy, capacity, spill", [
    ("dense", None, None), ("max_counts", None, None), ("ragged", None, None),
    ("cap_and_spill", 1, 0), ("cap_and_spill", 2, 2)])
def test_invalid_picks_are_dropped_alike_on_every_strategy(strategy, capacity, spill):
    """Duplicate, too large and negative ids: dropped, counted, no gradient."""
    ranks, tokens, num_experts, top_k = 4, 5, 8, 4
    ids = _invalid_routing(11, ranks * tokens, num_experts, top_k)
    x, _, w = random_case(12, ranks, tokens, num_experts, top_k, HIDDEN, "random")
    scales = _scales(num_experts)
    out, dropped, dx, dw, _, _ = strategy_grads(strategy, x, jnp.asarray(ids), w, scales,
                                             1 if strategy == "dense" else ranks,
                                             capacity=capacity, spill=spill)
    kept = np.asarray(mj.plan.kept_picks(jnp.asarray(ids), num_experts))
    assert dropped == int((~kept).sum()) > 0
    want = _kept_sum(np.asarray(x), ids, np.asarray(w), np.asarray(scales), num_experts)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    assert not dw[~kept].any(), "a dropped pick's weight must get no gradient"
    assert dw[kept].all()
    if strategy != "dense":
        _check_grads_against_dense(strategy, ranks, x, jnp.asarray(ids), w, scales,
                                   capacity=capacity, spill=spill)


def _nvlink_reference_grads(x, ids, w, scales, ranks, fp8=False):
    mesh, spec = mesh_of(ranks, "cpu"), P("ep")
    num_experts = scales.shape[0]
    ops = ReferenceOps("ep", ranks, num_experts // ranks)

    def body(x, ids, w, scales):   # scales: this rank's experts
        ids = mj.plan.drop_invalid_picks(ids, num_experts)
        got = nvlink_grad.dispatch(ops, x, ids, fp8=fp8)
        y = rowwise_experts(scales)(got.rows, got.group_sizes)
        return nvlink_grad.combine(ops, y, got, ids, w)

    run = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
    ct = jax.random.normal(jax.random.key(0), x.shape, jnp.float32)

    def loss(x, w, scales):
        out = run(x, ids, w, scales)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        put(x), put(w), put(scales))
    return (np.asarray(out), *map(np.asarray, grads))


@pytest.mark.parametrize("ranks, top_k, kind", [(4, 3, "zipf"), (8, 4, "one_rank"),
                                                (2, 8, "random"), (4, 1, "empty_rank")])
def test_nvlink_gradient_rules_on_the_reference_give_dense_bits(ranks, top_k, kind):
    num_experts = 8
    x, ids, w = random_case(ranks + top_k, ranks, 6, num_experts, top_k, HIDDEN, kind)
    scales = _scales(num_experts)
    got = _nvlink_reference_grads(x, ids, w, scales, ranks)
    want = strategy_grads("dense", x, ids, w, scales, 1)
    for name, g, d in zip(("out", "dx", "dweights"), got[:3], (want[0], want[2], want[3])):
        _assert_bits(g, d, f"nvlink reference: {name} differs from dense")
    assert rel_error(got[3], want[4]) < PARAM_RTOL


def test_nvlink_gradient_rules_drop_invalid_picks():
    ranks, num_experts = 4, 8
    ids = _invalid_routing(3, ranks * 4, num_experts, 3)
    x, _, w = random_case(4, ranks, 4, num_experts, 3, HIDDEN, "random")
    scales = _scales(num_experts)
    got = _nvlink_reference_grads(x, jnp.asarray(ids), w, scales, ranks)
    want = strategy_grads("dense", x, jnp.asarray(ids), w, scales, 1)
    for g, d in zip(got[:3], (want[0], want[2], want[3])):
        _assert_bits(g, d, "nvlink reference with dropped picks")


def test_nvlink_fp8_gradient_is_straight_through():
    """fp8 rows: the forward is dense's on the quantized tokens, and the
    tokens' gradient is dense's there (the quantization passes as identity)."""
    ranks, num_experts, hidden = 4, 8, 128
    x, ids, w = random_case(6, ranks, 4, num_experts, 2, hidden, "random", jnp.bfloat16)
    scales = jax.random.normal(jax.random.key(1), (num_experts, hidden), jnp.float32)
    got = _nvlink_reference_grads(x, ids, w, scales, ranks, fp8=True)
    values, block_scales = quantize_e4m3(x)
    x_q = dequantize(values, block_scales, jnp.bfloat16)
    want = strategy_grads("dense", x_q, ids, w, scales, 1)
    for name, g, d in zip(("out", "dx", "dweights"), got[:3], (want[0], want[2], want[3])):
        _assert_bits(g, d, f"fp8: {name}")

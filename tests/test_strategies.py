"""Every strategy delivers the rows `dense` delivers, bit for bit, and the
same layer output: within tolerance with XLA's expert matmul, bit for bit
with the row-invariant one (at any top-k, with and without the
cap-and-spill fallback), on 1, 4 and 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import moe_jax as mj
from moe_jax.dispatch import DispatchContext, dispatch_combine
from moe_testing import (ROUTINGS, bits, expected_rank_rows, random_case, rel_error, run_dense,
                         run_strategy)

HIDDEN, FFN = 16, 24


def _experts(num_experts, seed=7):
    return mj.init_expert_weights(jax.random.key(seed), num_experts, HIDDEN, FFN)


def _check_against_dense(strategy, ranks, tokens, num_experts, top_k, kind, seed, capacity=None,
                         spill=None, impl="custom_call", transport="lax", dtype=jnp.float32,
                         matmul="xla"):
    x, ids, w = random_case(seed, ranks, tokens, num_experts, top_k, HIDDEN, kind, dtype)
    experts = _experts(num_experts)
    ref_out, ref_rows, ref_sizes = run_dense(x, ids, w, experts, matmul=matmul)
    out, rows, valid, stats = run_strategy(strategy, x, ids, w, experts, ranks,
                                           capacity=capacity, spill=spill, impl=impl,
                                           transport=transport, matmul=matmul)
    for rank, expected in enumerate(expected_rank_rows(ref_rows, ref_sizes, ranks)):
        n = expected.shape[0]
        assert valid[rank, :n].all() and not valid[rank, n:].any(), (
            f"rank {rank}: delivered {valid[rank].sum()} rows, dense delivered {n}")
        np.testing.assert_array_equal(bits(rows[rank, :n]), bits(expected),
                                      err_msg=f"rank {rank}: rows differ from dense")
    if matmul == "row_invariant":
        np.testing.assert_array_equal(bits(out), bits(ref_out),
                                      err_msg=f"{strategy}: output differs from dense")
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert rel_error(out, ref_out) < tol
    assert int(stats.rows) == ids.size and int(stats.dropped_rows) == 0
    return stats


case = st.fixed_dictionaries(dict(
    ranks=st.sampled_from([4, 8]),
    tokens=st.sampled_from([1, 4, 12]),
    experts_per_rank=st.sampled_from([1, 2]),
    top_k=st.sampled_from([1, 2, 3]),
    kind=st.sampled_from(ROUTINGS),
    seed=st.integers(0, 2**31 - 1),
))


@given(case, st.sampled_from(["max_counts", "ragged"]))
def test_strategy_rows_match_dense(c, strategy):
    num_experts = c["ranks"] * c["experts_per_rank"]
    _check_against_dense(strategy, c["ranks"], c["tokens"], num_experts,
                         min(c["top_k"], num_experts), c["kind"], c["seed"])


@given(case, st.sampled_from([1, 2, 5]), st.sampled_from([0, 1, 3]))
def test_cap_and_spill_rows_match_dense(c, capacity, spill):
    num_experts = c["ranks"] * c["experts_per_rank"]
    _check_against_dense("cap_and_spill", c["ranks"], c["tokens"], num_experts,
                         min(c["top_k"], num_experts), c["kind"], c["seed"],
                         capacity=capacity, spill=spill)


@pytest.mark.parametrize("ranks", [4, 8])
def test_cap_and_spill_overflow_beyond_c_plus_s_takes_exact_fallback(ranks):
    stats = _check_against_dense("cap_and_spill", ranks, 16, 2 * ranks, 2, "one_expert", 3,
                                 capacity=1, spill=1)
    assert int(stats.fallback_steps) == 1
    assert int(stats.overflow_rows) > 0 and int(stats.spilled_rows) > 0


def test_cap_and_spill_within_capacity_skips_fallback():
    stats = _check_against_dense("cap_and_spill", 4, 4, 8, 2, "random", 11, capacity=8,
                                 spill=2)
    assert int(stats.fallback_steps) == 0 and int(stats.spill_steps) == 0
    assert int(stats.spilled_rows) == 0 and int(stats.overflow_rows) == 0


def test_rank_that_receives_nothing():
    x, ids, w = random_case(5, 4, 8, 8, 2, HIDDEN, "empty_rank")
    assert not np.any(np.asarray(ids) >= 6)
    for strategy, cap, spill in (("max_counts", None, None), ("ragged", None, None),
                                 ("cap_and_spill", 1, 1)):
        _check_against_dense(strategy, 4, 8, 8, 2, "empty_rank", 5, capacity=cap, spill=spill)


@pytest.mark.parametrize("strategy", ["max_counts", "cap_and_spill", "ragged"])
@pytest.mark.parametrize("transport", ["lax", "custom_call"])
@pytest.mark.parametrize("impl", ["custom_call", "reference"])
def test_bfloat16_rows_bitwise_and_output_close(strategy, transport, impl):
    cap = dict(capacity=2, spill=1) if strategy == "cap_and_spill" else {}
    _check_against_dense(strategy, 4, 8, 8, 2, "zipf", 21, impl=impl, transport=transport,
                         dtype=jnp.bfloat16, **cap)


def test_transports_agree_bitwise():
    x, ids, w = random_case(9, 8, 6, 16, 2, HIDDEN, "zipf")
    experts = _experts(16)
    outs = [run_strategy("cap_and_spill", x, ids, w, experts, 8, capacity=1, spill=1,
                         transport=t)[0] for t in ("lax", "custom_call")]
    np.testing.assert_array_equal(bits(outs[0]), bits(outs[1]))


top_k_case = st.fixed_dictionaries(dict(
    ranks=st.sampled_from([4, 8]),
    tokens=st.sampled_from([1, 5, 12]),
    experts_per_rank=st.sampled_from([1, 2]),
    top_k=st.sampled_from([1, 3, 4, 8]),
    kind=st.sampled_from(ROUTINGS),
    seed=st.integers(0, 2**31 - 1),
    transport=st.sampled_from(["lax", "custom_call"]),
    strategy=st.sampled_from([("max_counts", None, None), ("ragged", None, None),
                              ("cap_and_spill", 1, 0), ("cap_and_spill", 1, 1),
                              ("cap_and_spill", 2, 3)]),
))


@given(top_k_case)
def test_row_invariant_output_is_dense_bits_at_any_top_k(c):
    """A token's picks may travel in different cap-and-spill passes (tiny C
    and S force the spill pass and the fallback); the output is still
    dense's, bit for bit."""
    strategy, capacity, spill = c["strategy"]
    num_experts = c["ranks"] * c["experts_per_rank"]
    _check_against_dense(strategy, c["ranks"], c["tokens"], num_experts,
                         min(c["top_k"], num_experts), c["kind"], c["seed"], capacity=capacity,
                         spill=spill, transport=c["transport"], matmul="row_invariant")


@pytest.mark.parametrize("top_k", [3, 4, 8])
@pytest.mark.parametrize("ranks", [4, 8])
def test_fallback_at_large_top_k_gives_dense_bits(top_k, ranks):
    stats = _check_against_dense("cap_and_spill", ranks, 6, 2 * ranks, top_k, "one_rank", 17,
                                 capacity=1, spill=1, matmul="row_invariant")
    assert int(stats.fallback_steps) == 1 and int(stats.overflow_rows) > 0


def _scaling_experts(scales):
    """Expert e multiplies its rows by scales[e] (exact in float32)."""
    def fn(rows, group_sizes):
        expert = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes,
                            total_repeat_length=rows.shape[0])
        return rows * scales[expert][:, None]
    return fn


@pytest.mark.parametrize("strategy, capacity, spill", [
    ("dense", None, None), ("max_counts", None, None), ("ragged", None, None),
    ("cap_and_spill", 2, 0), ("cap_and_spill", 1, 1), ("cap_and_spill", 1, 0)])
def test_picks_in_different_passes_sum_in_pick_order(strategy, capacity, spill):
    """One rank, one token, experts scaling by 1, 1e-8, -1, picks (0, 2, 1):
    summed in pick order, 1 + (-1) + 1e-8 = 1e-8. With C = 2, S = 0 pick 1
    travels in the fallback; adding its partial sum last would give 0."""
    x = jnp.ones((1, 1), jnp.float32)
    ids = jnp.array([[0, 2, 1]], jnp.int32)
    w = jnp.ones((1, 3), jnp.float32)
    fn = _scaling_experts(jnp.array([1.0, 1e-8, -1.0], jnp.float32))
    ctx = DispatchContext(None, 1)
    res = jax.jit(lambda x, i, w: dispatch_combine(
        x, i, w, fn, strategy=strategy, ctx=ctx, experts_per_rank=3, capacity=capacity,
        spill_capacity=spill))(x, ids, w)
    assert float(res.out[0, 0]) == np.float32(1e-8)
    if strategy == "cap_and_spill" and capacity + spill < 3:
        assert int(res.stats.fallback_steps) == 1

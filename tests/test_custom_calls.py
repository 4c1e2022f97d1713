"""The CPU custom calls equal their pure-JAX references bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_jax import custom_calls
from moe_jax.ops import ffi
from moe_jax.plan import make_plan
from moe_testing import ROUTINGS, bits, make_routing, mesh_of

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _plan_case(seed, tokens, ranks, experts_per_rank, top_k, kind, hidden, dtype):
    rng = np.random.default_rng(seed)
    ids = make_routing(rng, tokens, ranks * experts_per_rank, top_k, kind, experts_per_rank)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    return x, make_plan(jnp.asarray(ids), ranks, experts_per_rank), rng


@given(st.integers(1, 24), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2]),
       st.integers(1, 3), st.sampled_from(ROUTINGS), st.integers(0, 9), st.integers(0, 6),
       st.integers(0, 4), st.sampled_from(DTYPES), st.integers(0, 2**31 - 1))
def test_pack_equals_reference(tokens, ranks, per_rank, top_k, kind, capacity, spill, start,
                               dtype, seed):
    top_k = min(top_k, ranks * per_rank)
    x, plan, _ = _plan_case(seed, tokens, ranks, per_rank, top_k, kind, 24, dtype)
    args = (x, plan.sorted_slots, plan.send_offsets, plan.send_counts)
    kw = dict(top_k=top_k, start=start, capacity=capacity, spill_capacity=spill)
    got = jax.jit(lambda *a: custom_calls.pack(*a, **kw))(*args)
    want = jax.jit(lambda *a: custom_calls.pack(*a, impl="reference", **kw))(*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(bits(np.asarray(g)), bits(np.asarray(w)))


@given(st.integers(1, 24), st.sampled_from([1, 2, 4, 8]), st.integers(1, 3),
       st.sampled_from(ROUTINGS), st.integers(0, 9), st.integers(0, 6), st.integers(0, 4),
       st.sampled_from(DTYPES), st.sampled_from(DTYPES), st.integers(0, 2**31 - 1))
def test_combine_equals_reference(tokens, ranks, top_k, kind, capacity, spill, start, dtype,
                                  out_dtype, seed):
    top_k = min(top_k, ranks)
    x, plan, rng = _plan_case(seed, tokens, ranks, 1, top_k, kind, 40, dtype)
    cap_ret = jnp.asarray(rng.standard_normal((ranks, capacity, 40)), dtype)
    spill_ret = jnp.asarray(rng.standard_normal((ranks, spill, 40)), dtype)
    weights = jnp.asarray(rng.standard_normal((tokens, top_k)), jnp.float32)
    args = (cap_ret, spill_ret, plan.dest, plan.pos, weights)
    got = jax.jit(lambda *a: custom_calls.combine(*a, start=start, out_dtype=out_dtype))(*args)
    want = jax.jit(lambda *a: custom_calls.combine(*a, start=start, out_dtype=out_dtype,
                                                   impl="reference"))(*args)
    assert got.dtype == jnp.dtype(out_dtype) and got.shape == (tokens, 40)
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)))


def _mesh(ranks):
    return mesh_of(ranks, "cpu")


@given(st.sampled_from([2, 4, 8]), st.integers(0, 2**31 - 1), st.sampled_from(DTYPES + [jnp.int32]))
def test_ragged_all_to_all_equals_reference(ranks, seed, dtype):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 4, size=(ranks, ranks)).astype(np.int32)  # [src, dst]
    sizes[rng.integers(ranks)] = 0  # one rank sends nothing
    send_rows, recv_rows = 3 * ranks + 1, 3 * ranks + 2
    send_offsets = np.concatenate([np.zeros((ranks, 1), np.int32),
                                   np.cumsum(sizes, 1)[:, :-1]], 1).astype(np.int32)
    recv_offsets = np.concatenate([np.zeros((1, ranks), np.int32),
                                   np.cumsum(sizes, 0)[:-1]], 0).T.astype(np.int32)  # [dst, src]
    send = jnp.asarray(rng.standard_normal((ranks * send_rows, 3, 5)) * 100, dtype)

    def body(impl):
        def f(s, so, ss, ro):
            return custom_calls.ragged_all_to_all(s, so, ss, ro, recv_rows=recv_rows,
                                                  axis_name="ep", impl=impl)
        return f

    mesh = _mesh(ranks)
    spec = P("ep")
    args = [jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec)) for a in
            (send, send_offsets.reshape(-1), sizes.reshape(-1), recv_offsets.reshape(-1))]
    results = [jax.jit(jax.shard_map(body(impl), mesh=mesh, in_specs=(spec,) * 4,
                                     out_specs=(spec, spec)))(*args)
               for impl in ("custom_call", "reference")]
    (got, got_sizes), (want, want_sizes) = results
    np.testing.assert_array_equal(np.asarray(got_sizes), sizes.T.reshape(-1))
    np.testing.assert_array_equal(np.asarray(got_sizes), np.asarray(want_sizes))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def test_all_to_all_inside_a_loop():
    ranks, mesh = 8, _mesh(8)

    def body(x):
        def step(i, acc):
            return custom_calls.all_to_all(acc + i, axis_name="ep")
        return jax.lax.fori_loop(0, 3, step, x)

    x = jnp.arange(ranks * ranks * 2, dtype=jnp.float32).reshape(ranks * ranks, 2)
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
        jax.device_put(x, NamedSharding(mesh, P("ep"))))
    got = run(lambda x: body(x.reshape(ranks, 1, 2)).reshape(ranks, 2))

    def lax_body(x):
        def step(i, acc):
            return jax.lax.all_to_all(acc + i, "ep", 0, 0, tiled=False)
        return jax.lax.fori_loop(0, 3, step, x)

    want = run(lambda x: lax_body(x.reshape(ranks, 1, 2)).reshape(ranks, 2))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_pack_rejects_bad_operands():
    x = jnp.ones((4, 8), jnp.float32)
    idx = jnp.zeros((8,), jnp.int32)
    counts = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="'sorted_slots'"):
        custom_calls.pack(x, idx[:7], counts, counts, top_k=2, start=0, capacity=1,
                          spill_capacity=0)
    with pytest.raises(ValueError, match="'send_counts'"):
        custom_calls.pack(x, idx, counts, counts.astype(jnp.int64) if jax.config.x64_enabled
                          else counts.astype(jnp.float32), top_k=2, start=0, capacity=1,
                          spill_capacity=0)
    with pytest.raises(ValueError, match="'x'"):
        custom_calls.pack(x.astype(jnp.int32), idx, counts, counts, top_k=2, start=0,
                          capacity=1, spill_capacity=0)
    with pytest.raises(ValueError, match="'capacity'"):
        custom_calls.pack(x, idx, counts, counts, top_k=2, start=0, capacity=-1,
                          spill_capacity=0)


def test_combine_rejects_bad_operands():
    ret = jnp.ones((2, 3, 8), jnp.bfloat16)
    idx = jnp.zeros((8,), jnp.int32)
    w = jnp.ones((4, 2), jnp.float32)
    with pytest.raises(ValueError, match="'spill_ret'"):
        custom_calls.combine(ret, ret.astype(jnp.float32), idx, idx, w, start=0,
                             out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="'weights'"):
        custom_calls.combine(ret, ret, idx, idx, w.astype(jnp.bfloat16), start=0,
                             out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="'pos'"):
        custom_calls.combine(ret, ret, idx, idx[:5], w, start=0, out_dtype=jnp.float32)


@pytest.mark.parametrize("capacity, spill", [(5, 0), (0, 3)])
def test_combine_in_an_unjitted_shard_map_with_an_empty_window(capacity, spill):
    """Each primitive of an un-jitted shard_map compiles alone; a zero-sized
    window must still reach the custom call (XLA:CPU used to crash on it)."""
    ranks, tokens, top_k = 8, 6, 2
    mesh = _mesh(ranks)
    rng = np.random.default_rng(7)
    ids = jnp.asarray(rng.integers(0, ranks, (ranks * tokens, top_k)), jnp.int32)
    cap_ret = jnp.asarray(rng.standard_normal((ranks * ranks, capacity, 16)), jnp.float32)
    spill_ret = jnp.asarray(rng.standard_normal((ranks * ranks, spill, 16)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((ranks * tokens, top_k)), jnp.float32)

    def body(cap_ret, spill_ret, ids, weights):
        plan = make_plan(ids, ranks, 1)
        return custom_calls.combine(cap_ret, spill_ret, plan.dest, plan.pos, weights, start=0,
                                    out_dtype=jnp.float32)

    run = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep"))
    args = [jax.device_put(a, NamedSharding(mesh, P("ep")))
            for a in (cap_ret, spill_ret, ids, weights)]
    eager = run(*args)
    jitted = jax.jit(run)(*args)
    np.testing.assert_array_equal(bits(np.asarray(eager)), bits(np.asarray(jitted)))
    assert np.any(np.asarray(jitted) != 0)
    # A second eager call reuses the jitted call that builds the empty window.
    misses = ffi._jit_with_empties.cache_info().misses
    np.testing.assert_array_equal(bits(np.asarray(run(*args))), bits(np.asarray(eager)))
    assert ffi._jit_with_empties.cache_info().misses == misses

"""The VJPs of the custom calls (CPU): each equals JAX's own autodiff of the
pure-JAX reference, the custom call and the reference impl share bits, and
finite differences agree (jax.test_util.check_grads)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

from moe_jax import custom_calls, refs
from moe_jax.plan import make_plan
from moe_testing import ROUTINGS, bits, make_routing, mesh_of

HIDDEN = 12
IMPLS = ("custom_call", "reference")


def _plan(rng, tokens, ranks, experts_per_rank, top_k, kind):
    ids = make_routing(rng, tokens, ranks * experts_per_rank, top_k, kind, experts_per_rank)
    return make_plan(jnp.asarray(ids), ranks, experts_per_rank)


def _assert_same_bits(got, want, what):
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)), err_msg=what)


pack_case = st.fixed_dictionaries(dict(
    tokens=st.integers(1, 12), ranks=st.sampled_from([1, 2, 4]),
    experts_per_rank=st.sampled_from([1, 2]), top_k=st.integers(1, 4),
    kind=st.sampled_from(ROUTINGS), capacity=st.integers(0, 6), spill=st.integers(0, 4),
    start=st.integers(0, 3), seed=st.integers(0, 2**31 - 1)))


@given(pack_case)
def test_pack_vjp_is_a_unit_weight_combine(c):
    rng = np.random.default_rng(c["seed"])
    top_k = min(c["top_k"], c["ranks"] * c["experts_per_rank"])
    plan = _plan(rng, c["tokens"], c["ranks"], c["experts_per_rank"], top_k, c["kind"])
    x = jnp.asarray(rng.standard_normal((c["tokens"], HIDDEN)), jnp.float32)
    kw = dict(top_k=top_k, start=c["start"], capacity=c["capacity"],
              spill_capacity=c["spill"])
    ct = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
          ((c["ranks"], c["capacity"], HIDDEN), (c["ranks"], c["spill"], HIDDEN))]
    ints = (plan.sorted_slots, plan.send_offsets, plan.send_counts)

    def pullback(fn):
        _, vjp = jax.vjp(lambda x: fn(x, *ints, **kw), x)
        return jax.jit(vjp)(tuple(ct))[0]

    got = {impl: pullback(lambda *a, **k: custom_calls.pack(*a, impl=impl, **k))
           for impl in IMPLS}
    autodiff = pullback(refs.pack)
    _assert_same_bits(got["custom_call"], got["reference"], "impls differ")
    np.testing.assert_allclose(np.asarray(got["custom_call"]), np.asarray(autodiff),
                               rtol=1e-6, atol=1e-6)
    # Each token's gradient: its picks' window-row gradients summed in pick order.
    want = np.zeros((c["tokens"], HIDDEN), np.float32)
    pos, dest = np.asarray(plan.pos) - c["start"], np.asarray(plan.dest)
    for n in range(plan.num_slots):
        if 0 <= pos[n] < c["capacity"]:
            want[n // top_k] += np.asarray(ct[0])[dest[n], pos[n]]
        elif c["capacity"] <= pos[n] < c["capacity"] + c["spill"]:
            want[n // top_k] += np.asarray(ct[1])[dest[n], pos[n] - c["capacity"]]
    _assert_same_bits(got["custom_call"], want, "not the pick-order float32 sum")


combine_case = st.fixed_dictionaries(dict(
    tokens=st.integers(1, 12), ranks=st.sampled_from([1, 2, 4]), top_k=st.integers(1, 4),
    kind=st.sampled_from(ROUTINGS), capacity=st.integers(0, 6), spill=st.integers(0, 4),
    start=st.integers(0, 3), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**31 - 1)))


@given(combine_case)
def test_combine_vjp_scales_rows_and_dots_the_weights(c):
    rng = np.random.default_rng(c["seed"])
    top_k = min(c["top_k"], c["ranks"])
    plan = _plan(rng, c["tokens"], c["ranks"], 1, top_k, c["kind"])
    dtype = c["dtype"]
    cap = jnp.asarray(rng.standard_normal((c["ranks"], c["capacity"], HIDDEN)), dtype)
    spill = jnp.asarray(rng.standard_normal((c["ranks"], c["spill"], HIDDEN)), dtype)
    weights = jnp.asarray(rng.standard_normal((c["tokens"], top_k)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((c["tokens"], HIDDEN)), jnp.float32)

    def pullback(fn):
        _, vjp = jax.vjp(lambda a, b, w: fn(a, b, plan.dest, plan.pos, w, start=c["start"],
                                            out_dtype=jnp.float32), cap, spill, weights)
        return jax.jit(vjp)(g)

    got = {impl: pullback(lambda *a, **k: custom_calls.combine(*a, impl=impl, **k))
           for impl in IMPLS}
    autodiff = pullback(refs.combine)
    for i, name in enumerate(("cap_ret", "spill_ret", "weights")):
        _assert_same_bits(got["custom_call"][i], got["reference"][i], f"{name}: impls differ")
        np.testing.assert_allclose(np.asarray(got["custom_call"][i], np.float32),
                                   np.asarray(autodiff[i], np.float32), rtol=1e-5, atol=1e-5,
                                   err_msg=name)
    # Row gradients are single products: the same bits as autodiff's.
    _assert_same_bits(got["custom_call"][0], autodiff[0], "cap_ret gradient")
    _assert_same_bits(got["custom_call"][1], autodiff[1], "spill_ret gradient")
    q = np.asarray(plan.pos) - c["start"]
    outside = ~((q >= 0) & (q < c["capacity"] + c["spill"]))
    assert not np.asarray(got["custom_call"][2]).reshape(-1)[outside].any(), (
        "picks outside the windows must get a zero weight gradient")


def test_pack_and_combine_pass_finite_differences():
    rng = np.random.default_rng(3)
    plan = _plan(rng, 6, 2, 2, 3, "random")
    x = jnp.asarray(rng.standard_normal((6, HIDDEN)), jnp.float32)
    kw = dict(top_k=3, start=1, capacity=3, spill_capacity=2)
    ints = (plan.sorted_slots, plan.send_offsets, plan.send_counts)
    check_grads(lambda x: custom_calls.pack(x, *ints, **kw), (x,), order=1, modes=("rev",))
    cap = jnp.asarray(rng.standard_normal((2, 3, HIDDEN)), jnp.float32)
    spill = jnp.asarray(rng.standard_normal((2, 2, HIDDEN)), jnp.float32)
    weights = jnp.asarray(rng.random((6, 3)), jnp.float32)
    check_grads(lambda a, b, w: custom_calls.combine(a, b, plan.dest, plan.pos, w, start=1,
                                                     out_dtype=jnp.float32),
                (cap, spill, weights), order=1, modes=("rev",), eps=1e-2, atol=2e-3,
                rtol=2e-3)


def _a2a_case(rng, ranks, send_rows):
    sizes = rng.integers(0, 4, size=(ranks, ranks)).astype(np.int32)      # [src, dst]
    send_offsets = (np.cumsum(sizes, 1) - sizes).astype(np.int32)
    recv_offsets = (np.cumsum(sizes, 0) - sizes).T.astype(np.int32)       # [dst, src]
    send = rng.standard_normal((ranks * send_rows, HIDDEN)).astype(np.float32)
    return send, send_offsets, sizes, recv_offsets


@settings(max_examples=6)
@given(st.sampled_from([2, 4, 8]), st.integers(0, 2**31 - 1))
def test_ragged_all_to_all_vjp_is_the_reverse_all_to_all(ranks, seed):
    rng = np.random.default_rng(seed)
    send_rows, recv_rows = 3 * ranks + 1, 3 * ranks + 2
    send, send_offsets, sizes, recv_offsets = _a2a_case(rng, ranks, send_rows)
    g = rng.standard_normal((ranks * recv_rows, HIDDEN)).astype(np.float32)
    mesh, spec = mesh_of(ranks, "cpu"), P("ep")

    def body(impl):
        def f(s, so, ss, ro, g):
            def a2a(s):
                if impl == "autodiff":
                    return refs.ragged_all_to_all(s, so, ss, ro, recv_rows, axis_name="ep")[0]
                return custom_calls.ragged_all_to_all(s, so, ss, ro, recv_rows=recv_rows,
                                                      axis_name="ep", impl=impl)[0]
            return jax.vjp(a2a, s)[1](g)[0]
        return f

    counts = [a.reshape(-1) for a in (send_offsets, sizes, recv_offsets)]  # rank-major
    args = [jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))
            for a in (send, *counts, g)]
    got = {impl: np.asarray(jax.jit(jax.shard_map(body(impl), mesh=mesh, in_specs=(spec,) * 5,
                                                  out_specs=spec))(*args))
           for impl in IMPLS + ("autodiff",)}
    _assert_same_bits(got["custom_call"], got["reference"], "impls differ")
    _assert_same_bits(got["custom_call"], got["autodiff"], "not the reverse all-to-all")
    # Rows a rank sent nowhere get zero gradient; sent rows get the receiver's.
    for src in range(ranks):
        local = got["custom_call"][src * send_rows:(src + 1) * send_rows]
        sent = np.zeros(send_rows, bool)
        for dst in range(ranks):
            n, o = sizes[src, dst], send_offsets[src, dst]
            sent[o:o + n] = True
            r = recv_offsets[dst, src]
            np.testing.assert_array_equal(local[o:o + n], g[dst * recv_rows + r:
                                                            dst * recv_rows + r + n])
        assert not local[~sent].any()


def test_dense_all_to_all_gradient_flows_back_through_the_custom_call():
    ranks, mesh, spec = 4, mesh_of(4, "cpu"), P("ep")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((ranks * ranks, 2, HIDDEN)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((ranks * ranks, 2, HIDDEN)), jnp.float32)

    def body(use_custom_call):
        def f(x, ct):
            def a2a(x):
                if use_custom_call:
                    return custom_calls.all_to_all(x, axis_name="ep")
                return jax.lax.all_to_all(x, "ep", 0, 0, tiled=False)
            return jax.grad(lambda x: jnp.sum(a2a(x) * ct))(x)
        return f

    x, ct = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, ct))
    got, want = (jax.jit(jax.shard_map(body(c), mesh=mesh, in_specs=(spec, spec),
                                       out_specs=spec))(x, ct) for c in (True, False))
    _assert_same_bits(got, want, "dense all-to-all gradient")

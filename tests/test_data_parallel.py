"""Data x expert parallelism on CPU devices: tokens split over ("data",
"ep") meshes (and a 3-axis one), each data group an independent
expert-parallel group. Every group's experts receive the rows `dense`
delivers for that group's tokens, bit for bit, and (row-invariant matmul)
give its output bits at top-k 1 to 8; the layer gives dense's bits
with the row-invariant matmul; losses and stats cover all groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_jax as mj
from moe_jax import custom_calls
from moe_jax.layer import init_moe_params, moe_layer
from moe_jax.models import DecoderConfig, MixtralLinen, init_params
from moe_jax.models.generate import generate, pad_prompts
from moe_testing import (ROUTINGS, bits, expected_rank_rows, random_case, run_dense,
                         run_strategy)

HIDDEN, FFN = 16, 24
MESHES = [(2, 4), (4, 2), (8, 1)]   # (data, ep) over the 8 CPU devices


def _mesh(*shape_and_names):
    shape, names = shape_and_names[::2], shape_and_names[1::2]
    return jax.make_mesh(shape, names, devices=jax.devices("cpu")[:int(np.prod(shape))],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


case = st.fixed_dictionaries(dict(
    mesh=st.sampled_from(MESHES),
    tokens=st.sampled_from([1, 4, 9]),
    experts_per_rank=st.sampled_from([1, 2]),
    top_k=st.sampled_from([1, 2, 3, 4, 8]),
    kind=st.sampled_from(ROUTINGS),
    seed=st.integers(0, 2**31 - 1),
    transport=st.sampled_from(["lax", "custom_call"]),
    strategy=st.sampled_from([("max_counts", None, None), ("ragged", None, None),
                              ("cap_and_spill", 1, 0), ("cap_and_spill", 2, 1)]),
))


@given(case)
def test_every_group_delivers_the_dense_rows_of_its_tokens(c):
    data, ranks = c["mesh"]
    strategy, capacity, spill = c["strategy"]
    num_experts = ranks * c["experts_per_rank"]
    top_k = min(c["top_k"], num_experts)
    # random_case draws data * ranks ranks' tokens; group g holds rows
    # [g * ranks * tokens, (g + 1) * ranks * tokens).
    x, ids, w = random_case(c["seed"], data * ranks, c["tokens"], num_experts, top_k, HIDDEN,
                            c["kind"])
    experts = mj.init_expert_weights(jax.random.key(7), num_experts, HIDDEN, FFN)
    out, rows, valid, stats = run_strategy(strategy, x, ids, w, experts, ranks,
                                           capacity=capacity, spill=spill,
                                           transport=c["transport"], data=data,
                                           matmul="row_invariant")
    group_tokens = ranks * c["tokens"]
    for g in range(data):
        part = slice(g * group_tokens, (g + 1) * group_tokens)
        ref_out, ref_rows, ref_sizes = run_dense(x[part], ids[part], w[part], experts,
                                                 matmul="row_invariant")
        for r, expected in enumerate(expected_rank_rows(ref_rows, ref_sizes, ranks)):
            rank = g * ranks + r
            n = expected.shape[0]
            assert valid[rank, :n].all() and not valid[rank, n:].any(), (
                f"group {g} rank {r}: delivered {valid[rank].sum()} rows, dense {n}")
            np.testing.assert_array_equal(bits(rows[rank, :n]), bits(expected),
                                          err_msg=f"group {g} rank {r}: rows differ from dense")
        np.testing.assert_array_equal(bits(out[part]), bits(ref_out),
                                      err_msg=f"group {g}: output differs from dense")
        assert int(stats.rows[g]) == ids[part].size


@pytest.mark.parametrize("mesh_shape, names, data_axes", [
    ((2, 4), ("data", "ep"), ("data",)),
    ((4, 2), ("data", "ep"), ("data",)),
    ((2, 2, 2), ("pod", "data", "ep"), ("pod", "data")),
    ((2, 4), ("ep", "data"), ("data",)),   # the expert axis first in the mesh
])
@pytest.mark.parametrize("strategy, transport", [
    ("max_counts", "lax"), ("cap_and_spill", "lax"), ("cap_and_spill", "custom_call"),
    ("ragged", "custom_call"), ("ragged", "lax")])
def test_layer_gives_dense_bits_losses_and_stats(mesh_shape, names, data_axes, strategy,
                                                 transport):
    config = mj.MoEConfig(hidden_size=32, ffn_size=48, num_experts=8, top_k=2,
                          strategy=strategy, capacity=2, spill_capacity=1, transport=transport,
                          matmul="row_invariant", data_axes=data_axes)
    mesh = _mesh(*[v for pair in zip(mesh_shape, names) for v in pair])
    params = init_moe_params(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (4, 16, config.hidden_size))
    dense = config.replace(strategy="dense", transport="lax")
    want, want_aux = jax.jit(lambda p, x: moe_layer(p, x, dense))(params, x)
    got, aux = jax.jit(lambda p, x: moe_layer(p, x, config, mesh))(params, x)
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)))
    np.testing.assert_allclose(float(aux.load_balance_loss), float(want_aux.load_balance_loss),
                               rtol=1e-5)
    np.testing.assert_allclose(float(aux.router_z_loss), float(want_aux.router_z_loss),
                               rtol=1e-5)
    assert int(aux.stats.rows) == x.shape[0] * x.shape[1] * config.top_k
    tokens_per_rank, experts_per_rank = x.shape[0] * x.shape[1] // 8, 8 // mesh.shape["ep"]
    assert 0 < int(aux.stats.max_peer_rows) <= tokens_per_rank * min(2, experts_per_rank)


def test_stats_sum_the_groups_calls():
    """Groups spill independently: the stats add their rows, spilled and
    overflow rows, and flag the call if any group spilled."""
    config = mj.MoEConfig(hidden_size=32, ffn_size=48, num_experts=4, top_k=2,
                          strategy="cap_and_spill", capacity=1, spill_capacity=1,
                          data_axes=("data",))
    mesh = _mesh(2, "data", 4, "ep")
    params = init_moe_params(jax.random.key(2), config)
    x = jax.random.normal(jax.random.key(3), (64, config.hidden_size))
    _, aux = jax.jit(lambda p, x: moe_layer(p, x, config, mesh))(params, x)
    one_axis = config.replace(data_axes=())
    per_group = [jax.jit(lambda p, x: moe_layer(p, x, one_axis, _mesh(4, "ep")))(
        params, half)[1].stats for half in (x[:32], x[32:])]
    for field in ("rows", "spilled_rows", "overflow_rows"):
        assert int(getattr(aux.stats, field)) == sum(int(getattr(s, field)) for s in per_group)
    for field in ("max_peer_rows", "spill_steps", "fallback_steps"):
        assert int(getattr(aux.stats, field)) == max(int(getattr(s, field)) for s in per_group)
    assert int(aux.stats.overflow_rows) > 0


@given(st.sampled_from([(2, 4), (4, 2), (2, 2)]), st.integers(0, 2**31 - 1))
def test_cpu_all_to_all_runs_one_group_per_data_index(mesh_shape, seed):
    """The CPU all-to-all custom call on a ("data", "ep") mesh equals its
    all-gather reference: each data group exchanges only among itself."""
    data, ranks = mesh_shape
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 4, size=(data, ranks, ranks)).astype(np.int32)  # [g, src, dst]
    send_rows, recv_rows = 3 * ranks + 1, 3 * ranks + 2
    send_offsets = (np.cumsum(sizes, 2) - sizes).astype(np.int32)
    recv_offsets = np.swapaxes(np.cumsum(sizes, 1) - sizes, 1, 2).astype(np.int32)  # [g, dst, src]
    send = jnp.asarray(rng.standard_normal((data * ranks * send_rows, 2)), jnp.float32)
    mesh = _mesh(data, "data", ranks, "ep")
    spec = P(("data", "ep"))

    def body(impl):
        def f(s, so, ss, ro):
            return custom_calls.ragged_all_to_all(s, so, ss, ro, recv_rows=recv_rows,
                                                  axis_name="ep", impl=impl)
        return f

    args = [jax.device_put(jnp.asarray(a).reshape(-1), NamedSharding(mesh, spec)) for a in
            (send_offsets, sizes, recv_offsets)]
    send = jax.device_put(send, NamedSharding(mesh, spec))
    (got, got_sizes), (want, want_sizes) = [
        jax.jit(jax.shard_map(body(impl), mesh=mesh, in_specs=(spec,) * 4,
                              out_specs=(spec, spec)))(send, *args)
        for impl in ("custom_call", "reference")]
    np.testing.assert_array_equal(np.asarray(got_sizes), np.swapaxes(sizes, 1, 2).reshape(-1))
    np.testing.assert_array_equal(np.asarray(got_sizes), np.asarray(want_sizes))
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)))


def test_cpu_all_to_all_names_a_data_axis_left_automatic():
    mesh = _mesh(2, "data", 4, "ep")

    def f(x):
        sizes = jnp.ones((4,), jnp.int32)
        offsets = jnp.arange(4, dtype=jnp.int32)
        return custom_calls.ragged_all_to_all(x, offsets, sizes, offsets, recv_rows=4,
                                              axis_name="ep")[0]

    run = jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"), axis_names={"ep"})
    with pytest.raises(ValueError, match=r"\['data'\] are not"):
        jax.jit(run)(jnp.ones((16, 2), jnp.float32))


@pytest.mark.parametrize("value, message", [
    (("ep",), "other than expert_axis"),
    (("data", "data"), "distinct"),
    ((3,), "tuple of mesh axis names"),
    (("",), "tuple of mesh axis names"),
])
def test_bad_data_axes_name_the_field(value, message):
    with pytest.raises(ValueError, match=rf"MoEConfig\.data_axes: .*{message}"):
        mj.MoEConfig(hidden_size=8, ffn_size=8, num_experts=4, strategy="ragged",
                     data_axes=value)


def test_data_axes_accepts_a_name_or_a_list():
    base = dict(hidden_size=8, ffn_size=8, num_experts=4, strategy="ragged")
    assert mj.MoEConfig(**base, data_axes="data").data_axes == ("data",)
    assert mj.MoEConfig(**base, data_axes=["pod", "data"]).data_axes == ("pod", "data")


def test_layer_names_a_missing_data_axis_and_uneven_tokens():
    config = mj.MoEConfig(hidden_size=8, ffn_size=8, num_experts=4, strategy="ragged",
                          data_axes=("data",))
    params = init_moe_params(jax.random.key(0), config)
    with pytest.raises(ValueError, match=r"lacks the data axes \['data'\]"):
        moe_layer(params, jnp.ones((8, 8)), config, _mesh(4, "ep"))
    with pytest.raises(ValueError, match=r"'x' has 12 tokens.*8 ranks of mesh axes"):
        moe_layer(params, jnp.ones((12, 8)), config, _mesh(2, "data", 4, "ep"))


@pytest.mark.parametrize("strategy, transport", [("cap_and_spill", "lax"),
                                                 ("ragged", "custom_call")])
def test_decoder_generates_the_dense_tokens_on_a_data_and_expert_mesh(strategy, transport):
    cfg = DecoderConfig.create(vocab_size=64, d_model=32, num_heads=4, num_layers=2,
                               num_experts=8, top_k=2, ffn_size=64, max_len=16,
                               matmul="row_invariant")
    params = init_params(jax.random.key(0), cfg)
    rng = np.random.default_rng(0)
    prompts = pad_prompts([rng.integers(1, 64, size=n).tolist() for n in (3, 6, 2, 5, 6, 4, 1, 6)])
    want = generate(MixtralLinen(cfg), params, *prompts, max_new_tokens=6).tokens
    parallel = cfg.replace(strategy=strategy, transport=transport, capacity=1, spill_capacity=1,
                           data_axes=("data",))
    mesh = _mesh(2, "data", 4, "ep")
    got = generate(MixtralLinen(parallel, mesh), params, *prompts, max_new_tokens=6)
    np.testing.assert_array_equal(got.tokens, want)
    assert int(got.stats.rows) > 0
    with pytest.raises(ValueError, match=r"batch 4 does not split evenly over the 8 ranks"):
        generate(MixtralLinen(parallel, mesh), params, prompts[0][:4], prompts[1][:4],
                 max_new_tokens=2)


def test_explicit_mesh_keeps_the_inputs_sharding():
    config = mj.MoEConfig(hidden_size=32, ffn_size=48, num_experts=8, top_k=2,
                          strategy="ragged", transport="custom_call", matmul="row_invariant",
                          data_axes=("data",))
    mesh = jax.make_mesh((2, 4), ("data", "ep"), devices=jax.devices("cpu")[:8],
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    params = init_moe_params(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (4, 16, config.hidden_size))
    want, _ = jax.jit(lambda p, x: moe_layer(p, x, config.replace(strategy="dense")))(params, x)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    got, _ = jax.jit(lambda p, x: moe_layer(p, x, config, mesh))(params, x)
    assert got.sharding.spec == P("data", None, None)
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)))


def test_expert_mesh_layouts():
    one = mj.expert_mesh(4)
    assert one.axis_names == ("ep",) and one.shape["ep"] == 4
    two = mj.expert_mesh(2, data_parallel=4)
    assert two.axis_names == ("data", "ep") and (two.shape["data"], two.shape["ep"]) == (4, 2)
    assert list(two.devices.flat) == jax.devices()[:8]
    with pytest.raises(ValueError, match="needs 16 devices, got 8"):
        mj.expert_mesh(4, data_parallel=4)

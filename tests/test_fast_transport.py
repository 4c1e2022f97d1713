"""Transport "fast": the ragged strategy's rows along the FAST plan.

On 8 CPU devices with 2 x 4 and 4 x 2 emulated servers (and 1 x 8, 8 x 1):
the rows every expert receives and the layer output are bitwise dense's
with the row-invariant matmul, over random and adversarial routings;
jax.grad through the layer and through dispatch_combine is bitwise the
`lax` transport's; the staged exchange really runs (a host callback in the
program); its VJP is bitwise the reference all-to-all's; invalid
combinations raise ValueError naming the argument. The GPU tests at the
end (marked multi_gpu) run the same checks on 2 and 4 GPUs.
"""

import functools
import logging
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_jax as mj
from moe_jax import topology as moe_topology
from moe_jax.dispatch import DispatchContext, dispatch_combine
from moe_jax.fast import staged, staged_ffi, workloads
from moe_jax.fast.topology import Topology
from moe_jax.fast.transport import fast_all_to_all
from moe_jax.layer import init_moe_params, moe_layer
from moe_testing import (ROUTINGS, bits, expert_fn, expected_rank_rows, mesh_of,
                         needs_gpus, random_case, run_dense)

TOPOLOGIES = ("2x4", "4x2")
HIDDEN, FFN, EXPERTS = 16, 24, 8
CONFIG = mj.MoEConfig(hidden_size=HIDDEN, ffn_size=FFN, num_experts=EXPERTS, top_k=3,
                      strategy="ragged", transport="fast", fast_topology="2x4",
                      matmul="row_invariant", dtype=jnp.float32, load_balance_coef=0.5,
                      router_z_coef=0.1)


def _same_bits(got, want, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, what
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=what)


# -- dispatch_combine over the fast transport ---------------------------------

@functools.lru_cache(maxsize=None)
def _runner(transport, topology, ranks, top_k, backend="cpu"):
    """jit(grad-and-value) of sum(out * ct) through dispatch_combine on a
    1-D mesh of `ranks`; returns out, the delivered rows and the gradients
    of (x, weights, w_gate_up, w_down)."""
    mesh = mesh_of(ranks, backend)
    fast = Topology.parse(topology) if transport == "fast" else None
    ctx = DispatchContext("ep", ranks, transport, "custom_call",
                          "cpu" if backend == "cpu" else "gpu", tuple(mesh.devices.flat),
                          fast_topology=fast)
    local = EXPERTS // ranks

    def body(x, ids, w, ct, w_gate_up, w_down):
        def loss(x, w, w_gate_up, w_down):
            experts = expert_fn(mj.ExpertWeights(w_gate_up, w_down), jnp.float32,
                                "row_invariant")
            res = dispatch_combine(x, ids, w, experts, strategy="ragged", ctx=ctx,
                                   experts_per_rank=local, return_delivered=True)
            return jnp.sum(res.out * ct), (res.out, res.delivered.rows, res.delivered.valid)
        (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
            x, w, w_gate_up, w_down)
        return aux, grads

    spec, experts = P("ep"), P("ep")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4 + (experts,) * 2,
                               out_specs=((spec,) * 3, (spec, spec, experts, experts))))
    return mesh, fn


def _run(transport, topology, ranks, x, ids, w, ct, weights, backend="cpu"):
    mesh, fn = _runner(transport, topology, ranks, ids.shape[1], backend)
    tokens, experts = NamedSharding(mesh, P("ep")), NamedSharding(mesh, P("ep"))
    args = [jax.device_put(a, tokens) for a in (x, ids, w, ct)] + \
        [jax.device_put(a, experts) for a in weights]
    (out, rows, valid), grads = fn(*args)
    return (np.asarray(out), np.asarray(rows).reshape(ranks, -1, x.shape[1]),
            np.asarray(valid).reshape(ranks, -1), [np.asarray(g) for g in grads])


def _case(seed, ranks, top_k, kind, tokens_per_rank=12):
    x, ids, w = random_case(seed, ranks, tokens_per_rank, EXPERTS, top_k, HIDDEN, kind)
    weights = mj.init_expert_weights(jax.random.key(seed), EXPERTS, HIDDEN, FFN, jnp.float32)
    ct = jax.random.normal(jax.random.key(seed + 1), x.shape, jnp.float32)
    return x, ids, w, ct, weights


def _check_against_dense_and_lax(topology, kind, seed, top_k, backend="cpu"):
    ranks = Topology.parse(topology).num_gpus
    x, ids, w, ct, weights = _case(seed, ranks, top_k, kind)
    out, rows, valid, grads = _run("fast", topology, ranks, x, ids, w, ct, weights, backend)
    want_out, dense_rows, dense_sizes = run_dense(x, ids, w, weights, impl="custom_call",
                                                  matmul="row_invariant")
    _same_bits(out, want_out, "output")
    for r, want in enumerate(expected_rank_rows(dense_rows, dense_sizes, ranks)):
        assert valid[r].sum() == len(want)
        _same_bits(rows[r][valid[r]], want, f"rows of rank {r}")
    _, _, _, want_grads = _run("lax", topology, ranks, x, ids, w, ct, weights, backend)
    for name, g, want in zip(("x", "weights", "w_gate_up", "w_down"), grads, want_grads):
        _same_bits(g, want, f"gradient of {name}")
    assert np.abs(grads[0]).max() > 0 and np.abs(grads[2]).max() > 0


@given(st.sampled_from(TOPOLOGIES), st.sampled_from(ROUTINGS), st.sampled_from([1, 2, 3]),
       st.integers(0, 2**31 - 1))
def test_rows_output_and_gradients_over_random_and_adversarial_routings(
        topology, kind, top_k, seed):
    _check_against_dense_and_lax(topology, kind, seed, top_k)


@pytest.mark.parametrize("topology", ["1x8", "8x1"])
def test_one_server_and_one_gpu_per_server(topology):
    _check_against_dense_and_lax(topology, "zipf", 7, 2)


def test_invalid_picks_are_dropped_as_on_lax():
    """Negative, too large and repeated expert ids move nowhere on every
    transport: fast gives the lax transport's output and gradient bits."""
    x, ids, w, ct, weights = _case(5, 8, 3, "random")
    ids = np.array(ids)
    ids[::3, 1] = -1
    ids[1::5, 2] = EXPERTS + 2
    ids[2::7, 2] = ids[2::7, 0]
    ids = jnp.asarray(ids)
    out, _, _, grads = _run("fast", "4x2", 8, x, ids, w, ct, weights)
    want_out, _, _, want_grads = _run("lax", "4x2", 8, x, ids, w, ct, weights)
    _same_bits(out, want_out, "output")
    for name, g, want in zip(("x", "weights", "w_gate_up", "w_down"), grads, want_grads):
        _same_bits(g, want, f"gradient of {name}")
    assert np.all(grads[1][::3, 1] == 0)


# -- the layer ----------------------------------------------------------------

def _layer_grads(config, mesh, params, x, ct):
    def loss(p, x):
        y, aux = moe_layer(p, x, config, mesh)
        return jnp.sum(y.astype(jnp.float32) * ct) + aux.weighted_loss(config), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_layer_is_dense_bitwise_and_has_lax_gradients(topology):
    config = CONFIG.replace(fast_topology=topology)
    params = init_moe_params(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (4, 16, HIDDEN))
    ct = jax.random.normal(jax.random.key(2), x.shape)
    (loss, y), grads = _layer_grads(config, mesh_of(8), params, x, ct)
    (_, want_y), _ = _layer_grads(config.replace(strategy="dense"), None, params, x, ct)
    _same_bits(y, want_y, "layer output")
    lax = config.replace(transport="lax", fast_topology=None)
    (want_loss, _), want = _layer_grads(lax, mesh_of(8), params, x, ct)
    assert float(loss) == float(want_loss)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        _same_bits(g, w, "layer gradient")
    assert float(jnp.abs(grads[0].router).max()) > 0


def test_layer_runs_the_staged_exchange():
    """The program holds the host callback that plans the FAST schedule (the
    CPU path of the staged all-to-all); the lax transport's does not."""
    params = init_moe_params(jax.random.key(0), CONFIG)
    x = jnp.ones((32, HIDDEN))
    for transport, topology, want in (("fast", "4x2", True), ("lax", None, False)):
        config = CONFIG.replace(transport=transport, fast_topology=topology)
        text = str(jax.make_jaxpr(lambda p, x: moe_layer(p, x, config, mesh_of(8)))(params, x))
        assert ("pure_callback" in text) == want, transport


def test_layer_under_data_parallelism():
    """A ("data", "ep") mesh of 2 x 4: each group schedules its own traffic
    on 2 x 2 servers; output dense's bits, gradients the lax transport's."""
    config = CONFIG.replace(fast_topology="2x2", data_axes=("data",))
    mesh = mesh_of(4, data=2)
    params = init_moe_params(jax.random.key(3), config)
    x = jax.random.normal(jax.random.key(4), (64, HIDDEN))
    ct = jax.random.normal(jax.random.key(5), x.shape)
    (_, y), grads = _layer_grads(config, mesh, params, x, ct)
    dense = config.replace(strategy="dense", data_axes=())
    (_, want_y), _ = _layer_grads(dense, None, params, x, ct)
    _same_bits(y, want_y, "layer output")
    lax = config.replace(transport="lax", fast_topology=None)
    _, want = _layer_grads(lax, mesh, params, x, ct)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        _same_bits(g, w, "layer gradient")


@pytest.mark.parametrize("kernel_impl", ["custom_call", "reference"])
def test_default_topology_on_cpu_is_one_server(kernel_impl):
    config = CONFIG.replace(fast_topology=None, kernel_impl=kernel_impl)
    params = init_moe_params(jax.random.key(6), config)
    x = jax.random.normal(jax.random.key(7), (32, HIDDEN))
    y, _ = jax.jit(lambda p, x: moe_layer(p, x, config, mesh_of(4)))(params, x)
    want, _ = moe_layer(params, x, config.replace(strategy="dense"))
    _same_bits(y, want, "layer output")
    assert moe_topology.fast_topology(None, mesh_of(4), "ep") == Topology(
        1, 4, "default", "CPU devices")


# -- the exchange and its VJP -------------------------------------------------

@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_fast_all_to_all_and_its_vjp_equal_the_reference(topology):
    ranks, rows, out_rows = 8, 20, 40
    rng = np.random.default_rng(11)
    counts = workloads.zipf_matrix(rng, ranks, 0.9, mean=rows / ranks)
    counts = np.minimum(counts, rows // ranks).astype(np.int32)   # fits both buffers
    x = rng.standard_normal((ranks * rows, 3)).astype(np.float32)
    ct = rng.standard_normal((ranks * out_rows, 3)).astype(np.float32)
    mesh = mesh_of(ranks)
    topo = Topology.parse(topology)

    def body(x, c, ct, which):
        def f(x):
            if which == "fast":
                return fast_all_to_all(x, c[0], axis_name="ep", topology=topo,
                                       out_rows=out_rows, platform="cpu")
            return staged.reference_all_to_all(x, c[0], axis_name="ep", out_rows=out_rows)
        out, vjp, recv = jax.vjp(f, x, has_aux=True)
        (d_x,) = vjp(ct)
        return out, recv, d_x

    results = {}
    for which in ("fast", "reference"):
        fn = jax.jit(jax.shard_map(functools.partial(body, which=which), mesh=mesh,
                                   in_specs=(P("ep"),) * 3, out_specs=(P("ep"),) * 3))
        results[which] = [np.asarray(a) for a in fn(x, counts, ct)]
    for got, want, what in zip(results["fast"], results["reference"], ("out", "recv", "d_x")):
        np.testing.assert_array_equal(got, want, err_msg=what)
    d_x = results["fast"][2].reshape(ranks, rows, 3)
    sent = counts.sum(axis=1)
    for r in range(ranks):      # rows sent somewhere get a gradient, the rest zero
        assert np.all(d_x[r, sent[r]:] == 0) and np.all(d_x[r, :sent[r]] != 0)


# -- invalid combinations -----------------------------------------------------

@pytest.mark.parametrize("changes, argument", [
    (dict(strategy="cap_and_spill", capacity=2, spill_capacity=1), "MoEConfig.strategy"),
    (dict(strategy="max_counts"), "MoEConfig.strategy"),
    (dict(transport="lax"), "MoEConfig.fast_topology"),
    (dict(fast_topology="2by4"), "MoEConfig.fast_topology"),
    (dict(fast_topology="0x8"), "MoEConfig.fast_topology"),
])
def test_invalid_configs_name_the_argument(changes, argument):
    with pytest.raises(ValueError, match=argument):
        CONFIG.replace(**changes)


@pytest.mark.parametrize("topology", ["2x2", "3x3", "4x4"])
def test_topology_that_does_not_match_the_expert_axis(topology):
    config = CONFIG.replace(fast_topology=topology)
    params = init_moe_params(jax.random.key(0), config)
    with pytest.raises(ValueError, match="MoEConfig.fast_topology.*'ep' has 8 ranks"):
        moe_layer(params, jnp.ones((16, HIDDEN)), config, mesh_of(8))


def _fake_mesh(platform, processes):
    devices = np.array([SimpleNamespace(platform=platform, id=100 + i, process_index=i % processes,
                                        local_hardware_id=i) for i in range(4)])
    return SimpleNamespace(axis_names=("ep",), devices=devices, shape={"ep": 4})


def test_topology_resolution_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="MoEConfig.transport: 'fast' runs on CPU"):
        moe_topology.fast_topology("2x2", _fake_mesh("cpu", 2), "ep")
    with pytest.raises(ValueError, match="MoEConfig.fast_topology: cannot be detected"):
        moe_topology.fast_topology(None, _fake_mesh("gpu", 2), "ep")
    assert moe_topology.fast_topology("2x2", _fake_mesh("gpu", 2), "ep") == Topology(2, 2)


@pytest.mark.parametrize("found, level", [(Topology(2, 2, "nvlink_islands"), "INFO"),
                                          (Topology(1, 4, "default", "no GPU matrix"),
                                           "WARNING")])
def test_topology_detected_for_the_first_groups_gpus(monkeypatch, caplog, found, level):
    mesh = _fake_mesh("gpu", 1)
    mesh.devices = mesh.devices[::-1]       # rank r is the GPU of ordinal 3 - r
    seen = {}

    def detect(num_gpus, gpu_indices):
        seen.update(num_gpus=num_gpus, gpu_indices=gpu_indices)
        return found

    monkeypatch.setattr(moe_topology.jax, "local_devices", lambda backend: mesh.devices)
    monkeypatch.setattr(moe_topology, "detect_topology", detect)
    with caplog.at_level(logging.INFO, logger="moe_jax"):
        assert moe_topology.fast_topology(None, mesh, "ep") == found
    assert seen == dict(num_gpus=4, gpu_indices=[3, 2, 1, 0])
    assert [r.levelname for r in caplog.records] == [level]


@pytest.mark.parametrize("strategy, topology, argument", [
    ("max_counts", Topology(2, 2), "strategy"), ("cap_and_spill", Topology(2, 2), "strategy"),
    ("ragged", None, "ctx"), ("ragged", Topology(2, 4), "ctx")])
def test_dispatch_combine_refuses_what_fast_cannot_move(strategy, topology, argument):
    ctx = DispatchContext("ep", 4, "fast", "custom_call", "cpu", fast_topology=topology)
    x = jnp.ones((4, 8), jnp.float32)
    ids = jnp.zeros((4, 2), jnp.int32).at[:, 1].set(1)
    with pytest.raises(ValueError, match=f"argument '{argument}'"):
        dispatch_combine(x, ids, jnp.ones((4, 2), jnp.float32), lambda rows, sizes: rows,
                         strategy=strategy, ctx=ctx, experts_per_rank=2, capacity=1,
                         spill_capacity=1)


# -- GPUs (run on a multi-GPU host) -------------------------------------------

GPU_CASES = [(2, "1x2"), (2, "2x1"), (4, "1x4"), (4, "2x2"), (4, "4x1")]


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.parametrize("ranks, topology", GPU_CASES)
@pytest.mark.parametrize("kind", ["random", "one_expert", "zipf"])
def test_gpu_rows_output_and_gradients(ranks, topology, kind):
    """The staged custom call where built (else the callback path) on GPUs:
    rows and output dense's bits (dense on the CPU reference path, so the
    row-invariant matmul is compared across platforms only through the
    rows), gradients the lax transport's bits."""
    needs_gpus(ranks)
    x, ids, w, ct, weights = _case(ranks, ranks, 2, kind)
    out, rows, valid, grads = _run("fast", topology, ranks, x, ids, w, ct, weights, "gpu")
    _, dense_rows, dense_sizes = run_dense(x, ids, w, weights, impl="custom_call",
                                           matmul="row_invariant")
    for r, want in enumerate(expected_rank_rows(dense_rows, dense_sizes, ranks)):
        assert valid[r].sum() == len(want)
        _same_bits(rows[r][valid[r]], want, f"rows of rank {r}")
    want_out, _, _, want_grads = _run("lax", topology, ranks, x, ids, w, ct, weights, "gpu")
    _same_bits(out, want_out, "output")
    for name, g, want in zip(("x", "weights", "w_gate_up", "w_down"), grads, want_grads):
        _same_bits(g, want, f"gradient of {name}")


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.parametrize("ranks, topology", GPU_CASES + [(2, None), (4, None)])
def test_gpu_layer_is_dense_bitwise(ranks, topology):
    """bf16 layer on GPUs, the topology given or detected: output dense's
    bits on the same GPUs, gradients the lax transport's."""
    needs_gpus(ranks)
    config = CONFIG.replace(fast_topology=topology, dtype=jnp.bfloat16)
    mesh = mesh_of(ranks, "gpu")
    params = init_moe_params(jax.random.key(ranks), config)
    x = jax.random.normal(jax.random.key(1), (8 * ranks, HIDDEN))
    ct = jax.random.normal(jax.random.key(2), x.shape)
    (_, y), grads = _layer_grads(config, mesh, params, x, ct)
    (_, want_y), _ = _layer_grads(config.replace(strategy="dense"), None, params, x, ct)
    _same_bits(y, want_y, "layer output")
    lax = config.replace(transport="lax", fast_topology=None)
    _, want = _layer_grads(lax, mesh, params, x, ct)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        _same_bits(g, w, "layer gradient")
    if staged_ffi.available():
        config_text = str(jax.jit(lambda p, x: moe_layer(p, x, config, mesh)[0]).lower(
            params, x).as_text())
        assert "moe_jax_fast_staged_all_to_all" in config_text

"""The count-aware NVLink transport on 2 and 4 GPUs: rows bitwise equal to
a pure-NumPy reference at production shapes, exact combine, identical
results over repeated calls, changing routings, the strategy matrix, and
2 or 4 processes of one GPU each under jax.distributed."""

import functools
import hashlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_jax as mj
from moe_jax import nvlink
from moe_testing import ROUTINGS, bits, make_routing, mesh_of, needs_gpus, quantize_e4m3_np

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]


@functools.lru_cache(maxsize=None)
def _runner(ranks, experts_per_rank):
    """Dispatch, identity experts, combine: returns everything dispatch saw."""
    mesh = mesh_of(ranks, "gpu")

    def body(x, ids, w):
        channel, got = nvlink.dispatch(x, ids, experts_per_rank=experts_per_rank,
                                       axis_name="ep", mesh_devices=tuple(mesh.devices.flat))
        out = nvlink.combine(channel, got.rows, got, ids, w, axis_name="ep")
        counts = jax.lax.pcast(got.all_counts[None], "ep", to="varying")
        return out, got.rows, got.group_sizes, counts, got.slot_pos

    spec = P("ep")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3,
                               out_specs=(spec, spec, spec, spec, spec)))
    return mesh, fn


def _case(seed, ranks, tokens, num_experts, top_k, hidden, kind, dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ranks * tokens, hidden)).astype(np.float32)
    ids = make_routing(rng, ranks * tokens, num_experts, top_k, kind, num_experts // ranks)
    w = (rng.random((ranks * tokens, top_k)) + 0.05).astype(np.float32)
    return np.asarray(jnp.asarray(x, dtype)), ids, w


def _expected(x, ids, w, ranks, tokens, experts_per_rank):
    """Per-rank rows in the canonical order, and the identity-expert combine
    (float32, pick order, multiply and add rounded separately)."""
    num_experts = ranks * experts_per_rank
    src = np.repeat(np.arange(ranks), tokens)
    per_rank = []
    for r in range(ranks):
        rows = []
        for e in range(r * experts_per_rank, (r + 1) * experts_per_rank):
            for s in range(ranks):
                for t in np.nonzero((src == s)[:, None] & (ids == e))[0]:
                    rows.append(x[t])
        per_rank.append(np.stack(rows) if rows else np.zeros((0, x.shape[1]), x.dtype))
    acc = np.zeros(x.shape, np.float32)
    xf = x.astype(np.float32)
    for j in range(ids.shape[1]):
        acc = (acc + (w[:, j:j + 1] * xf).astype(np.float32)).astype(np.float32)
    del num_experts
    return per_rank, acc.astype(x.dtype)


def _run(ranks, experts_per_rank, x, ids, w):
    mesh, fn = _runner(ranks, experts_per_rank)
    sharding = NamedSharding(mesh, P("ep"))
    outs = fn(*(jax.device_put(a, sharding) for a in (x, ids, w)))
    return [np.asarray(o) for o in outs]


def _check(ranks, tokens, num_experts, top_k, hidden, kind, dtype, seed):
    experts_per_rank = num_experts // ranks
    x, ids, w = _case(seed, ranks, tokens, num_experts, top_k, hidden, kind, dtype)
    out, rows, sizes, counts, slot_pos = _run(ranks, experts_per_rank, x, ids, w)
    want_rows, want_out = _expected(x, ids, w, ranks, tokens, experts_per_rank)
    rows = rows.reshape(ranks, -1, hidden)
    sizes = sizes.reshape(ranks, experts_per_rank)
    for r in range(ranks):
        n = want_rows[r].shape[0]
        assert sizes[r].sum() == n, f"rank {r}: {sizes[r].sum()} rows, want {n}"
        np.testing.assert_array_equal(bits(rows[r, :n]), bits(want_rows[r]),
                                      err_msg=f"rank {r}: delivered rows differ")
    # every rank holds the same counts matrix, equal to the routing's
    src = np.repeat(np.arange(ranks), tokens)
    want_counts = np.zeros((ranks, ranks, experts_per_rank), np.int32)
    np.add.at(want_counts, (src[:, None].repeat(top_k, 1), ids // experts_per_rank,
                            ids % experts_per_rank), 1)
    for r in range(ranks):
        np.testing.assert_array_equal(counts[r], want_counts)
    np.testing.assert_array_equal(bits(out), bits(want_out), err_msg="combine differs")
    return out, rows


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("kind", ROUTINGS)
def test_rows_and_combine_exact(ranks, kind):
    needs_gpus(ranks)
    _check(ranks, 24, 4 * ranks, 3, 256, kind, jnp.bfloat16, seed=ranks * 10 + ROUTINGS.index(kind))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_other_dtypes(dtype):
    needs_gpus(2)
    _check(2, 16, 4, 2, 64, "random", dtype, seed=7)


def test_production_shape_top8_of_256():
    """hidden 7168, 128 tokens per GPU, top-8 of 256 experts."""
    needs_gpus(4)
    _check(4, 128, 256, 8, 7168, "zipf", jnp.bfloat16, seed=1)


def test_changing_routing_reuses_buffers_exactly():
    """Consecutive calls alternate buffers; stale rows must never leak."""
    needs_gpus(4)
    for i, kind in enumerate(["random", "one_expert", "empty_rank", "one_rank", "zipf",
                              "random", "one_expert"]):
        _check(4, 32, 16, 2, 512, kind, jnp.bfloat16, seed=100 + i)


def test_same_inputs_twenty_times_same_hash():
    needs_gpus(4)
    x, ids, w = _case(5, 4, 64, 32, 4, 1024, "zipf", jnp.bfloat16)
    hashes = set()
    for _ in range(20):
        out, rows, sizes, _, _ = _run(4, 8, x, ids, w)
        rows = rows.reshape(4, -1, 1024)
        sizes = sizes.reshape(4, -1).sum(axis=1)
        h = hashlib.sha256(out.tobytes())
        for r in range(4):
            h.update(rows[r, :sizes[r]].tobytes())
        hashes.add(h.hexdigest())
    assert len(hashes) == 1, f"{len(hashes)} different results from identical inputs"


def test_layer_strategies_match_lax_transport():
    """The MoE layer with transport='nvlink' equals the lax transport."""
    needs_gpus(4)
    mesh = jax.make_mesh((4,), ("ep",), devices=jax.devices("gpu")[:4],
                         axis_types=(jax.sharding.AxisType.Auto,))
    outs = {}
    for strategy, transport in [("ragged", "lax"), ("ragged", "nvlink"),
                                ("cap_and_spill", "nvlink")]:
        config = mj.MoEConfig(hidden_size=128, ffn_size=64, num_experts=8, top_k=2,
                              strategy=strategy, capacity=4, spill_capacity=2,
                              transport=transport, dtype=jnp.float32)
        params = mj.init_moe_params(jax.random.key(0), config)
        x = jax.random.normal(jax.random.key(1), (4 * 32, 128), jnp.float32)
        out, aux = jax.jit(lambda p, t: mj.moe_layer(p, t, config, mesh=mesh))(params, x)
        outs[(strategy, transport)] = np.asarray(out)
        assert int(aux.stats.rows) == 4 * 32 * 2
        assert int(aux.stats.fallback_steps) == 0
    ref = outs[("ragged", "lax")]
    for key, out in outs.items():
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert err < 1e-5, f"{key}: relative error {err}"



def test_layer_with_fp8_dispatch():
    """MoEConfig.dispatch_fp8: the layer's experts see the tokens through e4m3
    with per-128 scales; the output stays close to the bf16 dispatch."""
    needs_gpus(4)
    mesh = jax.make_mesh((4,), ("ep",), devices=jax.devices("gpu")[:4],
                         axis_types=(jax.sharding.AxisType.Auto,))
    outs = {}
    for fp8 in (False, True):
        config = mj.MoEConfig(hidden_size=512, ffn_size=128, num_experts=8, top_k=2,
                              strategy="ragged", transport="nvlink", dispatch_fp8=fp8)
        params = mj.init_moe_params(jax.random.key(0), config)
        x = jax.random.normal(jax.random.key(1), (4 * 32, 512), jnp.bfloat16)
        out, aux = jax.jit(lambda p, t: mj.moe_layer(p, t, config, mesh=mesh))(params, x)
        outs[fp8] = np.asarray(out, np.float32)
        assert int(aux.stats.rows) == 4 * 32 * 2
    err = np.linalg.norm(outs[True] - outs[False]) / np.linalg.norm(outs[False])
    assert 0 < err < 0.1, f"fp8 dispatch relative error {err}"


def test_fused_calls_inside_a_loop():
    """Many calls of one channel in a fori_loop (XLA may unroll and reorder
    independent calls; the fused calls keep send and receive together)."""
    needs_gpus(4)
    mesh = mesh_of(4, "gpu")
    x, ids, w = _case(11, 4, 64, 8, 2, 512, "random", jnp.bfloat16)

    def body(x, ids, w):
        def step(i, acc):
            channel, got = nvlink.dispatch(x, ids, experts_per_rank=2, axis_name="ep",
                                           mesh_devices=tuple(mesh.devices.flat))
            return acc + nvlink.combine(channel, got.rows, got, ids, w,
                                        axis_name="ep").astype(jnp.float32)
        return jax.lax.fori_loop(0, 16, step, jnp.zeros_like(x, jnp.float32))

    spec = P("ep")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    sharding = NamedSharding(mesh, spec)
    out = np.asarray(fn(*(jax.device_put(a, sharding) for a in (x, ids, w))))
    _, once = _expected(x, ids, w, 4, 64, 2)
    np.testing.assert_allclose(out, 16 * once.astype(np.float32), rtol=1e-5)


def test_split_halves_with_work_between():
    needs_gpus(2)
    mesh = mesh_of(2, "gpu")
    x, ids, w = _case(12, 2, 32, 4, 2, 256, "zipf", jnp.bfloat16)
    devices = tuple(mesh.devices.flat)

    def body(x, ids, w):
        ch = nvlink.channel_for(x, ids, experts_per_rank=2, axis_name="ep", mesh_devices=devices)
        slot_pos, _ = nvlink.dispatch_send(ch, x, ids, axis_name="ep")
        shared = jnp.tanh(x.astype(jnp.float32)) * 2.0          # overlaps the transfer
        rows, sizes, counts = nvlink.dispatch_recv(ch, slot_pos, axis_name="ep")
        done = nvlink.combine_send(ch, rows, counts, axis_name="ep")
        out = nvlink.combine_recv(ch, done, ids, slot_pos, w, axis_name="ep")
        return out, shared

    spec = P("ep")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec)))
    sharding = NamedSharding(mesh, spec)
    for _ in range(3):
        out, _ = fn(*(jax.device_put(a, sharding) for a in (x, ids, w)))
        _, want = _expected(x, ids, w, 2, 32, 2)
        np.testing.assert_array_equal(bits(np.asarray(out)), bits(want))


@functools.lru_cache(maxsize=None)
def _fp8_runner(ranks, experts_per_rank, split):
    """fp8 dispatch, dequantized identity experts, bf16 combine."""
    mesh = mesh_of(ranks, "gpu")
    devices = tuple(mesh.devices.flat)

    def body(x, ids, w):
        if split:
            ch = nvlink.channel_for(x, ids, experts_per_rank=experts_per_rank, axis_name="ep",
                                    mesh_devices=devices, fp8=True)
            slot_pos, _ = nvlink.dispatch_send(ch, x, ids, axis_name="ep")
            rows, scales, sizes, counts = nvlink.dispatch_recv(ch, slot_pos, axis_name="ep")
            got = nvlink.Dispatched(rows, sizes, counts, slot_pos, scales)
        else:
            ch, got = nvlink.dispatch(x, ids, experts_per_rank=experts_per_rank,
                                      axis_name="ep", mesh_devices=devices, fp8=True)
        y = nvlink.dequantize(got.rows, got.scales)
        out = nvlink.combine(ch, y, got, ids, w, axis_name="ep")
        return out, jax.lax.bitcast_convert_type(got.rows, jnp.uint8), got.scales, \
            got.group_sizes

    spec = P("ep")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 4))
    return mesh, fn


def _check_fp8(ranks, tokens, num_experts, top_k, hidden, kind, seed, split=False):
    experts_per_rank = num_experts // ranks
    x, ids, w = _case(seed, ranks, tokens, num_experts, top_k, hidden, kind, jnp.bfloat16)
    x = np.array(x)
    x[0, :128] = 0          # an all-zero block: scale 1
    x[1, 5] = 3.0e4         # a large outlier in one block
    mesh, fn = _fp8_runner(ranks, experts_per_rank, split)
    sharding = NamedSharding(mesh, P("ep"))
    out, rows, scales, sizes = (np.asarray(o) for o in
                                fn(*(jax.device_put(a, sharding) for a in (x, ids, w))))
    q, s = quantize_e4m3_np(x)
    want_q, _ = _expected(q, ids, w, ranks, tokens, experts_per_rank)
    want_s, _ = _expected(s, ids, w, ranks, tokens, experts_per_rank)
    rows = rows.reshape(ranks, -1, hidden)
    scales = scales.reshape(ranks, -1, hidden // 128)
    sizes = sizes.reshape(ranks, experts_per_rank)
    for r in range(ranks):
        n = want_q[r].shape[0]
        assert sizes[r].sum() == n
        np.testing.assert_array_equal(rows[r, :n], want_q[r], err_msg=f"rank {r}: fp8 rows")
        np.testing.assert_array_equal(bits(scales[r, :n]), bits(want_s[r]),
                                      err_msg=f"rank {r}: scales")
    import ml_dtypes
    deq = (q.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(len(x), -1, 128)
           * s[..., None]).reshape(x.shape).astype(ml_dtypes.bfloat16)
    _, want_out = _expected(deq, ids, w, ranks, tokens, experts_per_rank)
    np.testing.assert_array_equal(bits(out), bits(want_out), err_msg="bf16 combine differs")


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("kind", ["random", "one_expert", "empty_rank", "zipf"])
def test_fp8_dispatch_exact(ranks, kind):
    needs_gpus(ranks)
    _check_fp8(ranks, 24, 4 * ranks, 3, 512, kind, seed=200 + ranks + ROUTINGS.index(kind))


def test_fp8_dispatch_top8_of_256_hidden_7168():
    needs_gpus(4)
    _check_fp8(4, 128, 256, 8, 7168, "zipf", seed=3)


def test_fp8_split_halves():
    needs_gpus(2)
    for i in range(3):
        _check_fp8(2, 32, 4, 2, 1024, "random", seed=300 + i, split=True)


SCRIPTS = os.path.join(os.path.dirname(__file__), "gpu_scripts")


def _run_processes(processes, env=None):
    proc = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "nvlink_multiprocess_check.py"), str(processes)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, f"failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.count("PASS") == processes, proc.stdout
    return proc.stdout


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_under_jax_distributed(processes):
    """One GPU per process: the channel's blocks are mapped through CUDA IPC
    handles exchanged over XLA's communicator; rows and combine stay exact
    (bf16 and fp8 dispatch, all-to-one-expert and empty-rank routings), and
    the layer (ragged, cap_and_spill) matches dense."""
    needs_gpus(processes)
    _run_processes(processes)


def test_processes_with_command_buffers():
    """As above with custom calls inside CUDA graphs: the exchange must run in
    the initialize stage, before capture."""
    needs_gpus(2)
    from moe_jax import _ffi_cuda
    if "initialize" not in _ffi_cuda.registrations()[nvlink.DISPATCH]:
        pytest.skip("the nvlink targets register no initialize stage")
    flags = ("--xla_gpu_graph_min_graph_size=1 "
             "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,COLLECTIVES")
    _run_processes(2, env={"XLA_FLAGS": flags})

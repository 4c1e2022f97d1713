"""Gradients on GPUs.

One GPU: the CUDA pack / combine VJPs equal the reference impl's bit for
bit; every strategy and transport at P = 1 gives dense's token and weight
gradient bits; the NVLink kernels' backward (dispatch, combine, fp8) equals
the pure-JAX reference ops' (moe_jax/nvlink_reference.py) at P = 1.
Several GPUs: the same for the NVLink kernels at P = 2 and 4, and every
strategy and transport (NCCL custom call and NVLink included) against dense.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_jax as mj
from moe_jax import custom_calls, nvlink, nvlink_grad
from moe_jax.nvlink_reference import ReferenceOps
from moe_jax.plan import make_plan
from moe_testing import (bits, make_routing, mesh_of, needs_gpus, random_case, rel_error,
                         rowwise_experts, strategy_grads)

pytestmark = pytest.mark.gpu
HIDDEN = 256


def _assert_bits(got, want, what):
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)), err_msg=what)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cuda_pack_and_combine_vjps_equal_the_reference_impl(dtype):
    rng = np.random.default_rng(0)
    tokens, ranks, top_k = 64, 4, 3
    plan = make_plan(jnp.asarray(make_routing(rng, tokens, ranks, top_k, "zipf", 1)), ranks, 1)
    x = jnp.asarray(rng.standard_normal((tokens, HIDDEN)), dtype)
    w = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((tokens, HIDDEN)), jnp.float32)

    def layer(impl):
        def f(x, w):
            kw = dict(impl=impl, platform="gpu")
            cap, spill = custom_calls.pack(x, plan.sorted_slots, plan.send_offsets,
                                           plan.send_counts, top_k=top_k, start=2, capacity=9,
                                           spill_capacity=5, **kw)
            return custom_calls.combine(jnp.tanh(cap), jnp.tanh(spill), plan.dest, plan.pos,
                                        w, start=2, out_dtype=jnp.float32, **kw)
        return jax.jit(lambda x, w: jax.vjp(f, x, w)[1](g))

    gpu = jax.devices("gpu")[0]
    got, want = (layer(impl)(*jax.device_put((x, w), gpu)) for impl in ("custom_call",
                                                                        "reference"))
    for a, b, name in zip(got, want, ("x", "weights")):
        _assert_bits(a, b, f"{name} gradient: CUDA differs from the reference impl")


@pytest.mark.parametrize("strategy, capacity, spill", [
    ("max_counts", None, None), ("ragged", None, None), ("cap_and_spill", 2, 1)])
@pytest.mark.parametrize("transport", ["lax", "custom_call", "nvlink"])
def test_every_strategy_at_one_rank_has_dense_gradient_bits(strategy, capacity, spill,
                                                            transport):
    x, ids, w = random_case(1, 1, 48, 8, 4, HIDDEN, "zipf")
    scales = jax.random.normal(jax.random.key(2), (8, HIDDEN), jnp.float32)
    want = strategy_grads("dense", x, ids, w, scales, 1)
    got = strategy_grads(strategy, x, ids, w, scales, 1, capacity=capacity, spill=spill,
                         transport=transport, backend="gpu")
    for i, name in ((0, "out"), (2, "dx"), (3, "dweights")):
        _assert_bits(got[i], want[i], f"{strategy}/{transport}: {name}")
    assert rel_error(got[4], want[4]) < 1e-5


@functools.lru_cache(maxsize=None)
def _ops_runner(ranks, num_experts, use_kernels, fp8):
    mesh = mesh_of(ranks, "gpu")

    def body(x, ids, w, scales):
        if use_kernels:
            ops = nvlink.ChannelOps(nvlink.channel_for(
                x, ids, experts_per_rank=num_experts // ranks, axis_name="ep",
                mesh_devices=tuple(mesh.devices.flat), fp8=fp8), "ep")
        else:
            ops = ReferenceOps("ep", ranks, num_experts // ranks)
        got = nvlink_grad.dispatch(ops, x, ids, fp8=fp8)
        y = rowwise_experts(scales)(got.rows, got.group_sizes)
        return nvlink_grad.combine(ops, y, got, ids, w)

    spec = P("ep")
    run = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)

    def loss(x, w, scales, ids, ct):
        out = run(x, ids, w, scales)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    return mesh, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _ops_grads(ranks, x, ids, w, scales, use_kernels, fp8=False):
    mesh, fn = _ops_runner(ranks, scales.shape[0], use_kernels, fp8)
    ct = jax.random.normal(jax.random.key(3), x.shape, jnp.float32)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))  # noqa: E731
    (_, out), grads = fn(put(x), put(w), put(scales), put(ids), put(ct))
    return [np.asarray(a) for a in (out, *grads)]


def _check_kernels_against_reference(ranks, top_k, kind, fp8=False):
    needs_gpus(ranks)
    num_experts = 4 * ranks
    dtype = jnp.bfloat16 if fp8 else jnp.float32
    hidden = 512 if fp8 else HIDDEN
    x, ids, w = random_case(10 * ranks + top_k, ranks, 40, num_experts, top_k, hidden, kind,
                            dtype)
    scales = jax.random.normal(jax.random.key(4), (num_experts, hidden), jnp.float32)
    got = _ops_grads(ranks, x, ids, w, scales, True, fp8)
    want = _ops_grads(ranks, x, ids, w, scales, False, fp8)
    for a, b, name in zip(got[:3], want[:3], ("out", "dx", "dweights")):
        if fp8:   # XLA:GPU may round the reference's float32 -> e4m3 differently
            assert rel_error(a, b) < 2e-2, f"fp8 at P={ranks}: {name}"
        else:
            _assert_bits(a, b, f"NVLink kernels at P={ranks}: {name} differs from the reference")
    assert rel_error(got[3], want[3]) < (2e-2 if fp8 else 1e-5)


@pytest.mark.parametrize("top_k, kind", [(1, "random"), (3, "zipf"), (4, "one_expert")])
def test_nvlink_kernels_backward_at_one_rank(top_k, kind):
    _check_kernels_against_reference(1, top_k, kind)


def test_nvlink_fp8_backward_at_one_rank():
    _check_kernels_against_reference(1, 2, "random", fp8=True)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("top_k, kind", [(2, "zipf"), (4, "one_rank")])
def test_nvlink_kernels_backward_on_several_gpus(ranks, top_k, kind):
    _check_kernels_against_reference(ranks, top_k, kind)


@pytest.mark.multi_gpu
def test_nvlink_fp8_backward_on_two_gpus():
    _check_kernels_against_reference(2, 2, "random", fp8=True)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("strategy, capacity, spill, transport", [
    ("max_counts", None, None, "custom_call"), ("cap_and_spill", 1, 1, "custom_call"),
    ("cap_and_spill", 1, 1, "lax"), ("ragged", None, None, "lax"),
    ("ragged", None, None, "nvlink"), ("cap_and_spill", 1, 1, "nvlink")])
def test_strategies_on_several_gpus_have_dense_gradients(ranks, strategy, capacity, spill,
                                                         transport):
    needs_gpus(ranks)
    x, ids, w = random_case(ranks, ranks, 32, 2 * ranks, 2, HIDDEN, "zipf")
    scales = jax.random.normal(jax.random.key(5), (2 * ranks, HIDDEN), jnp.float32)
    want = strategy_grads("dense", x, ids, w, scales, 1)
    got = strategy_grads(strategy, x, ids, w, scales, ranks, capacity=capacity, spill=spill,
                         transport=transport, backend="gpu")
    for i, name in ((0, "out"), (2, "dx"), (3, "dweights")):
        _assert_bits(got[i], want[i], f"{strategy}/{transport} at P={ranks}: {name}")
    assert rel_error(got[4], want[4]) < 1e-5


@pytest.mark.multi_gpu
@pytest.mark.parametrize("transport", ["custom_call", "nvlink"])
def test_layer_gradients_on_two_gpus(transport):
    needs_gpus(2)
    config = mj.MoEConfig(hidden_size=HIDDEN, ffn_size=128, num_experts=4, top_k=2,
                          strategy="cap_and_spill", capacity=4, spill_capacity=2,
                          transport=transport, dtype=jnp.float32)
    params = mj.init_moe_params(jax.random.key(6), config)
    x = jax.random.normal(jax.random.key(7), (64, HIDDEN))

    def loss(config, mesh):
        def f(p, x):
            y, aux = mj.moe_layer(p, x, config, mesh)
            return jnp.sum(y * jnp.cos(x)) + aux.weighted_loss(config)
        return jax.jit(jax.grad(f, argnums=(0, 1)))

    got = loss(config, mesh_of(2, "gpu"))(params, x)
    want = loss(config.replace(strategy="dense", transport="lax"), None)(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_error(a, b) < 1e-4


def _ragged_case(ranks, send_rows, recv_rows, width, seed):
    """Per-pair row counts and each rank's offsets for a ragged exchange."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((ranks, ranks), np.int32)            # [src, dst]
    for src in range(ranks):
        cut = np.sort(rng.integers(0, send_rows + 1, ranks - 1))
        counts[src] = np.diff(np.concatenate([[0], cut, [send_rows]]))
    counts = np.minimum(counts, recv_rows // ranks)
    send_offsets = np.cumsum(counts, axis=1) - counts       # into src's send buffer
    recv_offsets = (np.cumsum(counts, axis=0) - counts).T   # [dst, src] into dst's buffer
    send = rng.standard_normal((ranks, send_rows, width)).astype(np.float32)
    ct = rng.standard_normal((ranks, recv_rows, width)).astype(np.float32)
    return counts, send_offsets.astype(np.int32), recv_offsets.astype(np.int32), send, ct


@pytest.mark.multi_gpu
@pytest.mark.parametrize("send_rows, recv_rows", [(12, 20), (20, 12)])
def test_xla_ragged_all_to_all_vjp_is_the_reverse_exchange(send_rows, recv_rows):
    """The GPU `lax` exchange of the ragged strategy: rows land where the
    receiver's offsets say, and the gradient of every sent row is the
    cotangent of the row it became (zero for rows sent nowhere)."""
    from moe_jax.dispatch.context import xla_ragged_all_to_all
    ranks = 2
    needs_gpus(ranks)
    counts, send_off, recv_off, send, ct = _ragged_case(ranks, send_rows, recv_rows, 8, 1)
    mesh = mesh_of(ranks, "gpu")

    def body(send, send_off, sizes, recv_off, ct):
        def loss(send):
            out, _ = xla_ragged_all_to_all(send, send_off, sizes, recv_off, recv_rows, "ep")
            return jnp.sum(out * ct), out
        (_, out), d_send = jax.value_and_grad(loss, has_aux=True)(send)
        return out, d_send

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 5,
                                out_specs=(P("ep"), P("ep"))))
    flat = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731
    out, d_send = run(flat(send), flat(send_off), flat(counts), flat(recv_off), flat(ct))
    out = np.asarray(out).reshape(ranks, recv_rows, -1)
    d_send = np.asarray(d_send).reshape(ranks, send_rows, -1)
    want_out, want_d = np.zeros_like(out), np.zeros_like(d_send)
    for src in range(ranks):
        for dst in range(ranks):
            n, s, r = counts[src, dst], send_off[src, dst], recv_off[dst, src]
            want_out[dst, r:r + n] = send[src, s:s + n]
            want_d[src, s:s + n] = ct[dst, r:r + n]
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(d_send, want_d)

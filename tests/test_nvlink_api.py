"""The NVLink transport's trace-time checks (CPU): clear errors that name
the argument; its kernels are covered by tests/test_gpu_multi_nvlink.py."""

import types

import jax
import numpy as np
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import moe_jax as mj
from moe_jax import nvlink
from moe_testing import mesh_of, quantize_e4m3_np


def _lower(body, mesh, *args):
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * len(args), out_specs=P("ep"))
    return jax.jit(fn).lower(*args)


def test_config_accepts_nvlink():
    assert mj.MoEConfig(hidden_size=8, ffn_size=8, num_experts=2, strategy="ragged",
                        transport="nvlink").transport == "nvlink"


@pytest.mark.parametrize("platform, strategy, argument", [
    ("cpu", "ragged", "ctx"),            # the NVLink transport needs GPUs
    ("gpu", "max_counts", "strategy"),   # max_counts pads by definition
])
def test_dispatch_combine_checks_name_the_argument(platform, strategy, argument):
    mesh = mesh_of(2, "cpu")
    ctx = mj.DispatchContext("ep", 2, "nvlink", "custom_call", platform,
                             tuple(mesh.devices.flat))

    def body(x, ids, w):
        return mj.dispatch_combine(x, ids, w, lambda r, s: r, strategy=strategy, ctx=ctx,
                                   experts_per_rank=1).out

    with pytest.raises(ValueError, match=f"argument '{argument}'"):
        _lower(body, mesh, jnp.ones((8, 16)), jnp.zeros((8, 1), jnp.int32), jnp.ones((8, 1)))


@pytest.mark.parametrize("x, ids, argument", [
    (jnp.ones((4, 6), jnp.bfloat16), jnp.zeros((4, 1), jnp.int32), "x"),       # 12-byte rows
    (jnp.ones((4, 16), jnp.int32), jnp.zeros((4, 1), jnp.int32), "x"),         # not float
    (jnp.ones((4, 16), jnp.float32), jnp.zeros((4, 1), jnp.int64 if jax.config.x64_enabled
                                               else jnp.int16), "expert_ids"),
    (jnp.ones((4, 16), jnp.float32), jnp.zeros((3, 1), jnp.int32), "expert_ids"),
])
def test_channel_checks_name_the_operand(x, ids, argument):
    mesh = mesh_of(2, "cpu")

    def body(x, ids):
        nvlink.channel_for(x, ids, experts_per_rank=1, axis_name="ep",
                           mesh_devices=tuple(mesh.devices.flat))
        return x

    with pytest.raises(ValueError, match=f"argument '{argument}'"):
        _lower(body, mesh, jnp.concatenate([x, x]), jnp.concatenate([ids, ids]))


def test_channel_rejects_cpu_devices():
    mesh = mesh_of(2, "cpu")

    def body(x, ids):
        nvlink.channel_for(x, ids, experts_per_rank=1, axis_name="ep",
                           mesh_devices=tuple(mesh.devices.flat))
        return x

    with pytest.raises(ValueError, match="argument 'mesh_devices'"):
        _lower(body, mesh, jnp.ones((8, 16)), jnp.zeros((8, 1), jnp.int32))


def test_channel_size_is_the_worst_case():
    mesh = mesh_of(4, "cpu")
    groups = None

    def body(x, ids):
        nonlocal groups
        groups = mj.custom_calls.replica_groups("ep")
        return x

    _lower(body, mesh, jnp.ones((8, 16)), jnp.zeros((8, 1), jnp.int32))
    assert groups.shape == (1, 4)
    ch = nvlink.Channel(groups, 2, 128, 8, 7168, jnp.dtype(jnp.bfloat16))
    assert ch.rows == 4 * 128 * 2
    assert int(ch.attrs()["row_bytes"]) == 7168 * 2


@pytest.mark.parametrize("x", [jnp.ones((4, 512), jnp.float32),     # fp8 needs bf16
                               jnp.ones((4, 256), jnp.bfloat16)])   # H % 512 != 0
def test_fp8_dispatch_checks_x(x):
    mesh = mesh_of(2, "cpu")

    def body(x, ids):
        nvlink.channel_for(x, ids, experts_per_rank=1, axis_name="ep",
                           mesh_devices=tuple(mesh.devices.flat), fp8=True)
        return x

    with pytest.raises(ValueError, match="argument 'x'.*fp8"):
        _lower(body, mesh, x, jnp.zeros((4, 1), jnp.int32))


def test_quantize_e4m3_matches_numpy_reference():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 1024)) * np.exp(rng.uniform(-8, 8, (16, 1)))).astype(np.float32)
    x[0, :128] = 0
    x[1, 3] = 6.0e4
    x = np.asarray(jnp.asarray(x, jnp.bfloat16))
    with jax.default_device(jax.devices("cpu")[0]):  # the reference is defined on the CPU backend
        values, scales = jax.jit(nvlink.quantize_e4m3)(x)
    want_values, want_scales = quantize_e4m3_np(x)
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8), want_values)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    back = np.asarray(nvlink.dequantize(values, scales, jnp.float32))
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value relative to its block's amax
    blocks = np.abs(np.asarray(x, np.float32)).reshape(16, -1, 128).max(-1, keepdims=True)
    err = np.abs(back - np.asarray(x, np.float32)).reshape(16, -1, 128)
    assert np.all(err <= blocks * 2.0 ** -4 + 1e-30)


@pytest.mark.parametrize("changes", [dict(transport="lax"), dict(dtype=jnp.float32),
                                     dict(hidden_size=256)])
def test_dispatch_fp8_config_checks(changes):
    kw = dict(hidden_size=512, ffn_size=64, num_experts=4, strategy="ragged",
              transport="nvlink", dispatch_fp8=True)
    assert mj.MoEConfig(**kw).dispatch_fp8
    with pytest.raises(ValueError, match="MoEConfig.dispatch_fp8"):
        mj.MoEConfig(**{**kw, **changes})


def _fake_gpus(processes, ordinals):
    return [types.SimpleNamespace(platform="gpu", process_index=p, local_hardware_id=o)
            for p, o in zip(processes, ordinals)]


def test_group_layout_one_gpu_per_process():
    """A (dp=2, ep=2) mesh over 4 processes of one GPU each: every member is
    GPU 0 of its process; the groups name XLA's communicator."""
    groups = np.array([[0, 1], [2, 3]])
    layout = nvlink.group_layout(groups, _fake_gpus([0, 1, 2, 3], [0, 0, 0, 0]))
    assert layout.multi_process
    np.testing.assert_array_equal(layout.device_ordinals, np.zeros((2, 2)))
    np.testing.assert_array_equal(layout.replica_groups, groups)
    ch = nvlink.Channel(layout.device_ordinals, 1, 8, 2, 256, jnp.dtype(jnp.bfloat16), False,
                        layout.replica_groups, layout.multi_process)
    attrs = ch.attrs()
    assert int(attrs["multi_process"]) == 1 and int(attrs["group_size"]) == 2
    np.testing.assert_array_equal(attrs["replica_groups"], [0, 1, 2, 3])
    np.testing.assert_array_equal(attrs["device_ordinals"], [0, 0, 0, 0])
    assert attrs["replica_groups"].dtype == np.int64


def test_group_layout_groups_along_the_first_axis():
    """Groups along the first axis of a 2 x 2 mesh of 2 processes x 2 GPUs:
    each group has one member in each process, with the same local ordinal."""
    groups = np.array([[0, 2], [1, 3]])
    layout = nvlink.group_layout(groups, _fake_gpus([0, 0, 1, 1], [0, 1, 0, 1]))
    assert layout.multi_process
    np.testing.assert_array_equal(layout.device_ordinals, [[0, 0], [1, 1]])
    np.testing.assert_array_equal(layout.replica_groups, groups)


def test_group_layout_one_process_is_single_process():
    layout = nvlink.group_layout(np.array([[0, 1, 2, 3]]), _fake_gpus([0] * 4, [3, 2, 1, 0]))
    assert not layout.multi_process
    np.testing.assert_array_equal(layout.device_ordinals, [[3, 2, 1, 0]])
    ch = nvlink.Channel(layout.device_ordinals, 2, 128, 8, 7168, jnp.dtype(jnp.bfloat16))
    assert int(ch.attrs()["multi_process"]) == 0
    np.testing.assert_array_equal(ch.attrs()["replica_groups"], [0, 1, 2, 3])


def test_group_layout_unknown_remote_ordinal():
    devices = _fake_gpus([0, 1], [0, None])
    layout = nvlink.group_layout(np.array([[0, 1]]), devices)
    np.testing.assert_array_equal(layout.device_ordinals, [[0, -1]])


@pytest.mark.parametrize("platforms, ranks, argument", [
    (["gpu", "cpu"], 2, "mesh_devices"),
    (["gpu"] * 16, 16, "axis_name"),
])
def test_group_layout_checks_name_the_argument(platforms, ranks, argument):
    devices = [types.SimpleNamespace(platform=p, process_index=i, local_hardware_id=0)
               for i, p in enumerate(platforms)]
    with pytest.raises(ValueError, match=f"argument '{argument}'"):
        nvlink.group_layout(np.arange(ranks).reshape(1, ranks), devices)

"""The NVLink transport in N processes, one GPU each, under jax.distributed.

    python tests/gpu_scripts/nvlink_multiprocess_check.py N

Starts N copies of itself (process ids 0..N-1) on a free local port. Each
builds the same global inputs and, on a mesh of all N GPUs:

  * runs nvlink dispatch + combine (bf16, then fp8 dispatch) for several
    routings in a row (all to one expert, an empty rank, ...; fresh random
    inputs each, one channel reused throughout) and checks its own rank's
    delivered rows, group sizes and combined tokens bit for bit against the
    NumPy reference of tests/test_gpu_multi_nvlink.py;
  * runs the MoE layer with transport 'nvlink' (strategies ragged and
    cap_and_spill) and checks its shard against the float32 dense layer.

Each process prints PASS. The channel's IPC handles are exchanged on the
first call (XLA's initialize stage, or the first execution).
"""

import os
import sys

from launch_copies import run_copies

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DISPATCH_ROUTINGS = ("random", "one_expert", "empty_rank", "one_rank", "zipf", "random")
FP8_ROUTINGS = ("random", "one_expert", "empty_rank", "zipf")


def launch(num: int) -> int:
    return run_copies(__file__, num, timeout=540)


def _global_array(mesh, host):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    sharding = NamedSharding(mesh, P("ep"))
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _my_rank(mesh, array) -> tuple[int, object]:
    """(rank, local shard) of this process's single GPU."""
    (shard,) = array.addressable_shards
    return list(mesh.devices.flat).index(shard.device), shard


def _dispatch_fn(mesh, experts_per_rank, fp8):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from moe_jax import nvlink

    devices = tuple(mesh.devices.flat)

    def body(x, ids, w):
        channel, got = nvlink.dispatch(x, ids, experts_per_rank=experts_per_rank,
                                       axis_name="ep", mesh_devices=devices, fp8=fp8)
        if not fp8:
            out = nvlink.combine(channel, got.rows, got, ids, w, axis_name="ep")
            return out, got.rows, got.group_sizes
        y = nvlink.dequantize(got.rows, got.scales)
        out = nvlink.combine(channel, y, got, ids, w, axis_name="ep")
        return (out, jax.lax.bitcast_convert_type(got.rows, jnp.uint8), got.group_sizes,
                got.scales)

    outs = 4 if fp8 else 3
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3,
                                 out_specs=(P("ep"),) * outs))


def _bytes(a):
    import numpy as np

    return np.ascontiguousarray(a).view(np.uint8)


def check_dispatch(mesh, num, fp8, kind, seed) -> None:
    """One routing through nvlink dispatch + combine, checked bitwise."""
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from moe_testing import bits, quantize_e4m3_np  # noqa: PLC0415 (after jax.distributed)
    from test_gpu_multi_nvlink import _case, _expected

    tokens, top_k, hidden = 24, 3, 512
    experts_per_rank = 4
    x, ids, w = _case(seed, num, tokens, num * experts_per_rank, top_k, hidden, kind,
                      jnp.bfloat16)
    x = np.array(x)
    fn = _dispatch_fn(mesh, experts_per_rank, fp8)
    results = fn(*(_global_array(mesh, a) for a in (x, ids, w)))
    rank, out_shard = _my_rank(mesh, results[0])
    out = np.asarray(out_shard.data)
    rows = np.asarray(results[1].addressable_shards[0].data)
    sizes = np.asarray(results[2].addressable_shards[0].data)
    if fp8:
        q, s = quantize_e4m3_np(x)
        want_rows = _expected(q, ids, w, num, tokens, experts_per_rank)[0][rank]
        want_scales = _expected(s, ids, w, num, tokens, experts_per_rank)[0][rank]
        deq = (q.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(len(x), -1, 128)
               * s[..., None]).reshape(x.shape).astype(ml_dtypes.bfloat16)
        want_out = _expected(deq, ids, w, num, tokens, experts_per_rank)[1]
    else:
        want_rows, want_out = _expected(x, ids, w, num, tokens, experts_per_rank)
        want_rows = want_rows[rank]
    n = want_rows.shape[0]
    what = f"process {rank} ({'fp8' if fp8 else 'bf16'}, {kind})"
    if sizes.sum() != n:
        sys.exit(f"FAIL {what}: {sizes.sum()} rows delivered, want {n}")
    if not np.array_equal(_bytes(rows[:n]), _bytes(want_rows)):
        sys.exit(f"FAIL {what}: delivered rows differ")
    if fp8:
        scales = np.asarray(results[3].addressable_shards[0].data)
        if not np.array_equal(bits(scales[:n]), bits(want_scales)):
            sys.exit(f"FAIL {what}: delivered scales differ")
    if not np.array_equal(bits(out), bits(want_out[out_shard.index])):
        sys.exit(f"FAIL {what}: combined tokens differ")


def check_layer(mesh, num, strategy) -> None:
    """The MoE layer over transport 'nvlink', with row-invariant matmuls,
    against the dense layer on this process's GPU: bitwise equal."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import moe_jax as mj

    config = mj.MoEConfig(hidden_size=128, ffn_size=64, num_experts=2 * num, top_k=2,
                          strategy=strategy, capacity=4, spill_capacity=2,
                          transport="nvlink", dtype=jnp.float32, matmul="row_invariant")
    params = mj.init_moe_params(jax.random.key(0), config)
    host_x = np.asarray(jax.random.normal(jax.random.key(1), (32 * num, 128), jnp.float32))
    x = _global_array(mesh, host_x)
    replicated = NamedSharding(mesh, P())
    params = jax.tree.map(lambda a: jax.make_array_from_callback(
        a.shape, replicated, lambda idx, a=np.asarray(a): a[idx]), params)
    y, aux = jax.jit(lambda p, t: mj.moe_layer(p, t, config, mesh))(params, x)
    gpu = jax.local_devices()[0]
    dense = config.replace(strategy="dense", transport="lax")
    local_params = jax.tree.map(lambda a: jax.device_put(np.asarray(a.addressable_data(0)), gpu),
                                params)
    ref = np.asarray(jax.jit(lambda p, t: mj.moe_layer(p, t, dense)[0])(
        local_params, jax.device_put(host_x, gpu)))
    (shard,) = y.addressable_shards
    got = np.asarray(shard.data, np.float32)
    want = ref[shard.index]
    if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        sys.exit(f"FAIL layer {strategy}: output differs from dense (relative error {err})")
    if int(aux.stats.rows) != 32 * num * 2:
        sys.exit(f"FAIL layer {strategy}: {int(aux.stats.rows)} rows")


def child(num: int, pid: int, port: int) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num,
                               process_id=pid, local_device_ids=[pid])
    sys.path.insert(0, TESTS)
    mesh = jax.make_mesh((num,), ("ep",), devices=jax.devices("gpu"),
                         axis_types=(jax.sharding.AxisType.Auto,))
    for i, kind in enumerate(DISPATCH_ROUTINGS):
        check_dispatch(mesh, num, fp8=False, kind=kind, seed=400 + i)
    for i, kind in enumerate(FP8_ROUTINGS):
        check_dispatch(mesh, num, fp8=True, kind=kind, seed=500 + i)
    for strategy in ("ragged", "cap_and_spill"):
        check_layer(mesh, num, strategy)
    print(f"PASS process {pid}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    if len(sys.argv) == 2:
        sys.exit(launch(int(sys.argv[1])))
    child(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))

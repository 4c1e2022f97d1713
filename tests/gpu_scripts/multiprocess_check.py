"""cap_and_spill over NCCL in N processes, one GPU each, under jax.distributed.

    python tests/gpu_scripts/multiprocess_check.py N

Starts N copies of itself (process ids 0..N-1) on a free local port; each
builds the same global inputs, runs the layer with the NCCL transport on a
mesh of all N GPUs, and checks its own shard of the output against the
float32 dense reference. Each process prints PASS.
"""

import sys

from launch_copies import run_copies


def launch(num: int) -> int:
    return run_copies(__file__, num, timeout=240)


def child(num: int, pid: int, port: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num,
                               process_id=pid, local_device_ids=[pid])
    import moe_jax as mj

    config = mj.MoEConfig(hidden_size=256, ffn_size=128, num_experts=2 * num, top_k=2,
                          strategy="cap_and_spill", capacity=2, spill_capacity=1,
                          transport="custom_call")
    mesh = jax.make_mesh((num,), ("ep",), devices=jax.devices("gpu"),
                         axis_types=(jax.sharding.AxisType.Auto,))
    params = mj.init_moe_params(jax.random.key(0), config)
    host_x = np.asarray(jax.random.normal(jax.random.key(1), (32 * num, 256), jnp.float32))
    sharding = NamedSharding(mesh, P("ep"))
    x = jax.make_array_from_callback(host_x.shape, sharding, lambda idx: host_x[idx])
    replicated = NamedSharding(mesh, P())
    params = jax.tree.map(lambda a: jax.make_array_from_callback(
        a.shape, replicated, lambda idx, a=np.asarray(a): a[idx]), params)
    y, aux = jax.jit(lambda p, x: mj.moe_layer(p, x, config, mesh))(params, x)
    cpu = jax.local_devices(backend="cpu")[0]
    dense = config.replace(strategy="dense", dtype=jnp.float32, kernel_impl="reference",
                           transport="lax")
    host_params = jax.tree.map(lambda a: jax.device_put(np.asarray(a.addressable_data(0)), cpu),
                               params)
    with jax.default_device(cpu):
        ref = np.asarray(jax.jit(lambda p, x: mj.moe_layer(p, x, dense)[0])(
            host_params, jax.device_put(host_x, cpu)))
    for shard in y.addressable_shards:
        got = np.asarray(shard.data, np.float32)
        want = ref[shard.index]
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        if not err < 2e-2:
            sys.exit(f"FAIL process {pid}: relative error {err}")
    print(f"PASS process {pid}: rows {int(aux.stats.rows)}, "
          f"fallback {int(aux.stats.fallback_steps)}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    if len(sys.argv) == 2:
        sys.exit(launch(int(sys.argv[1])))
    child(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))

"""A small MoE layer under jit on 8 CPU devices, with every dispatch strategy.

    python examples/moe_layer_cpu.py [--tokens_per_device=32] [--strategy=...]
                                     [--data_parallel=2]

Prints, for each strategy, how far its output is from the float32 dense
reference, what the dispatch moved (spill and fallback counts) and the time
per call. With --data_parallel=D the devices form a ("data", "ep") mesh of
D groups, each an expert-parallel group of devices / D ranks.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import moe_jax as mj  # noqa: E402
from moe_jax import cli  # noqa: E402
from moe_jax.layer import init_moe_params, moe_layer  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("devices", 8, "CPU devices on the mesh.")
flags.DEFINE_integer("data_parallel", 1, "Data-parallel groups D (the expert axis gets "
                     "devices / D ranks).")
flags.DEFINE_integer("tokens_per_device", 32, "Tokens on each device.")
flags.DEFINE_integer("hidden", 64, "Model width H.")
flags.DEFINE_integer("ffn", 128, "Expert width F.")
flags.DEFINE_integer("experts", 8, "Experts E (a multiple of the expert-axis ranks).")
flags.DEFINE_integer("top_k", 2, "Experts per token.")
flags.DEFINE_float("quantile", 0.99, "Quantile of per-peer counts that sets C.")
flags.DEFINE_multi_string("strategy", ["max_counts", "cap_and_spill", "ragged"],
                          "Strategies to run.")
flags.DEFINE_integer("steps", 5, "Timed calls per strategy.")


def calibrated_capacities(config, mesh, params, x):
    """C and S from the per-peer counts of a few routed batches."""
    counts = []
    for seed in range(8):
        xs = x + 0.5 * jax.random.normal(jax.random.key(100 + seed), x.shape)
        counts.append(np.asarray(peer_counts(params, xs, config, mesh)))
    calib = mj.calibrate(np.concatenate([c.reshape(-1) for c in counts]), FLAGS.quantile)
    return calib


def peer_counts(params, x, config, mesh):
    """[D * P, P] rows each source rank sends each rank of its group."""
    num_ranks = mesh.shape[config.expert_axis]
    tokens = x.reshape(mesh.devices.size, -1, config.hidden_size).astype(jnp.float32)
    logits = tokens @ params.router.astype(jnp.float32)
    routing = jax.vmap(lambda l: mj.routing.topk_softmax(l, config.top_k))(logits)
    dest = routing.expert_ids // (config.num_experts // num_ranks)
    return jax.vmap(lambda d: jnp.bincount(d.reshape(-1), length=num_ranks))(dest)


def main(argv):
    del argv
    devices = jax.devices()[:FLAGS.devices]
    data = FLAGS.data_parallel
    if FLAGS.tokens_per_device < 1:
        raise app.UsageError(f"--tokens_per_device={FLAGS.tokens_per_device} must be >= 1")
    if data < 1 or len(devices) % data:
        raise app.UsageError(f"--data_parallel={data} must divide the {len(devices)} devices")
    mesh = mj.expert_mesh(len(devices) // data, data, devices)
    config = mj.MoEConfig(hidden_size=FLAGS.hidden, ffn_size=FLAGS.ffn,
                          num_experts=FLAGS.experts, top_k=FLAGS.top_k, strategy="max_counts",
                          data_axes=("data",) if data > 1 else ())
    params = init_moe_params(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (len(devices) * FLAGS.tokens_per_device,
                                              FLAGS.hidden))
    calib = calibrated_capacities(config, mesh, params, x)
    layout = " x ".join(f"{mesh.shape[a]} {a}" for a in mesh.axis_names)
    print(f"moe_jax {mj.__version__} on {len(devices)} {devices[0].platform} devices "
          f"({layout}); custom calls for {mj.custom_calls.available_platforms()}")
    print(f"E={config.num_experts} top_k={config.top_k} H={config.hidden_size} "
          f"F={config.ffn_size} T={FLAGS.tokens_per_device} tokens/device")
    print(f"calibrated at q={FLAGS.quantile}: C={calib.capacity} S={calib.spill_capacity}")
    reference = jax.jit(lambda p, x: moe_layer(p, x, config.replace(
        strategy="dense", dtype=jnp.float32, kernel_impl="reference"))[0])(params, x)
    for strategy in FLAGS.strategy:
        cfg = config.replace(strategy=strategy, capacity=calib.capacity,
                             spill_capacity=calib.spill_capacity)
        layer = jax.jit(lambda p, x, cfg=cfg: moe_layer(p, x, cfg, mesh))
        y, aux = layer(params, x)
        jax.block_until_ready(y)
        start = time.perf_counter()
        for _ in range(FLAGS.steps):
            y, aux = layer(params, x)
        jax.block_until_ready(y)
        ms = (time.perf_counter() - start) / FLAGS.steps * 1e3
        err = float(jnp.linalg.norm(y.astype(jnp.float32) - reference)
                    / jnp.linalg.norm(reference))
        s = aux.stats
        print(f"{strategy:>14}: rel. error vs float32 dense {err:.2e}; rows {int(s.rows)}, "
              f"largest peer stream {int(s.max_peer_rows)}, spilled {int(s.spilled_rows)}, "
              f"fallback {'taken' if int(s.fallback_steps) else 'not taken'}; "
              f"{ms:.2f} ms/call")


if __name__ == "__main__":
    cli.run(main)

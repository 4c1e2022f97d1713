"""Where the time of one dispatch + combine goes on GPU 0, from a JAX profile.

    python -m benchmarks.profile_dispatch --tokens=256,4096 --out=DIR

For each method and T it traces 20 steps of the "dc" phase of
dispatch_bench (each step its own call, or with --timing=loop all steps in
one jitted loop, where the GPUs stay in step), then prints (and writes to DIR/profile_summary.txt) the
device time per step by kernel on GPU 0, largest first, the wall time per step and,
for the NVLink transport, its dispatch and combine kernels' time per step
(including their waits for peers).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import dispatch_bench as bench
from benchmarks.trace_summary import device_time_by_kernel, traced, write_summary

FLAGS = flags.FLAGS
flags.DEFINE_integer("profile_steps", 20, "Traced steps.")
flags.DEFINE_integer("top", 12, "Kernels listed per configuration.")


def main(argv):
    del argv
    mesh = bench._mesh()
    ranks = mesh.shape["ep"]
    sharding = NamedSharding(mesh, P("ep"))
    os.makedirs(FLAGS.out, exist_ok=True)
    lines = []
    for tokens in map(int, FLAGS.tokens):
        ids, weights = bench._routing_batches(ranks, tokens, FLAGS.routings, FLAGS.seed)
        x = jax.device_put(jnp.ones((ranks * tokens, FLAGS.hidden), jnp.bfloat16), sharding)
        inputs = [(x, jax.device_put(i, sharding), jax.device_put(w, sharding))
                  for i, w in zip(ids, weights)]
        for method in FLAGS.methods:
            calib = bench._calibrate(ranks, tokens, 0.99) if "cap" in method else None
            fn = bench._build(method, "dc", ranks, tokens, calib and calib.capacity,
                              calib and calib.spill_capacity, None, mesh)
            if FLAGS.timing == "loop":  # all traced steps inside one jitted loop
                steps = NamedSharding(mesh, P(None, "ep"))
                reps = -(-FLAGS.profile_steps // len(ids))
                loop_inputs = (x, jax.device_put(np.concatenate([ids] * reps)[:FLAGS.profile_steps],
                                                 steps),
                               jax.device_put(np.concatenate([weights] * reps)
                                              [:FLAGS.profile_steps], steps))
                run = lambda: jax.block_until_ready(fn(*loop_inputs))
                calls = 1
            else:
                run_step = lambda i: jax.block_until_ready(fn(*inputs[i % len(inputs)]))
                run = None
                calls = FLAGS.profile_steps
            for i in range(2 if run else 5):
                run() if run else run_step(i)
            def run_all():
                for i in range(calls):
                    run() if run else run_step(i)
            name = f"trace_{method.replace(':', '_')}_{tokens}.json.gz"
            trace, wall = traced(run_all, os.path.join(FLAGS.out, name))
            wall = wall / FLAGS.profile_steps * 1e6
            if trace is None:
                lines.append(f"T={tokens} {method}: no trace written")
                continue
            kernels = device_time_by_kernel(trace, FLAGS.profile_steps)
            total = sum(kernels.values())
            lines.append(f"T={tokens} {method}: GPU0 busy {total:.1f} us/step, wall {wall:.1f} "
                         f"us/step (traced), {len(kernels)} kernel names")
            for k, v in kernels.most_common(FLAGS.top):
                lines.append(f"    {v:8.1f} us  {k}")
            nvlink = {k: v for k, v in kernels.items() if "nvlink::" in k}
            if nvlink:
                combine = sum(v for k, v in nvlink.items() if "Combine" in k)
                lines.append(f"    NVLink kernels per step: dispatch {sum(nvlink.values()) - combine:.1f}"
                             f" us (plan, quantize, send, receive), combine {combine:.1f} us "
                             "(send, receive)")
    write_summary(lines, os.path.join(FLAGS.out, "profile_summary.txt"))


if __name__ == "__main__":
    app.run(main)

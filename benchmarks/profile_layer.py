"""Where the time of one MoE layer call goes on GPU 0, from a JAX profile.

    python -m benchmarks.profile_layer --tokens=4096 --out=DIR

For each T it traces `--profile_steps` calls of the whole `moe_layer` on one
GPU (Mixtral shape, strategy dense, bf16 parameters, `--matmul`; with
`--train` the value and gradient of a loss instead), then prints (and writes
to DIR/profile_layer.txt) the device time per call by kernel, largest first,
the wall time per call and the GPU's span per call (first kernel start to
last kernel end over the traced calls, issued back to back: span above the
busy time is time the GPU sat idle).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks.trace_summary import (device_span_us, device_time_by_kernel, traced,
                                      write_summary)

FLAGS = flags.FLAGS
flags.DEFINE_list("tokens", ["4096"], "Tokens per call.")
flags.DEFINE_integer("hidden", 4096, "Hidden size.")
flags.DEFINE_integer("ffn", 14336, "Expert FFN size.")
flags.DEFINE_integer("experts", 8, "Experts.")
flags.DEFINE_integer("top_k", 2, "Experts per token.")
flags.DEFINE_string("matmul", "auto", "MoEConfig.matmul.")
flags.DEFINE_bool("train", False, "Profile value_and_grad of sum(out^2) instead.")
flags.DEFINE_integer("profile_steps", 10, "Traced calls.")
flags.DEFINE_integer("top", 14, "Kernels listed per configuration.")
flags.DEFINE_string("out", None, "Folder for the summary and traces (required).")


def main(argv):
    del argv
    import moe_jax as mj

    if not FLAGS.out:
        raise app.UsageError("--out is required")
    os.makedirs(FLAGS.out, exist_ok=True)
    config = mj.MoEConfig(hidden_size=FLAGS.hidden, ffn_size=FLAGS.ffn,
                          num_experts=FLAGS.experts, top_k=FLAGS.top_k, strategy="dense",
                          dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, matmul=FLAGS.matmul)
    params = mj.init_moe_params(jax.random.key(0), config)
    if FLAGS.train:
        loss = lambda p, x: jnp.sum(jnp.square(mj.moe_layer(p, x, config)[0].astype(jnp.float32)))
        fn = jax.jit(jax.value_and_grad(loss))
    else:
        fn = jax.jit(lambda p, x: mj.moe_layer(p, x, config)[0])
    lines = [f"moe_layer on {jax.devices()[0].device_kind}: hidden {FLAGS.hidden}, ffn "
             f"{FLAGS.ffn}, {FLAGS.experts} experts, top-{FLAGS.top_k}, matmul={FLAGS.matmul}, "
             f"{'value_and_grad' if FLAGS.train else 'forward'}"]
    for tokens in map(int, FLAGS.tokens):
        x = jax.random.normal(jax.random.key(tokens), (tokens, FLAGS.hidden), jnp.bfloat16)
        for _ in range(3):
            jax.block_until_ready(fn(params, x))
        def run():
            for _ in range(FLAGS.profile_steps):
                out = fn(params, x)
            jax.block_until_ready(out)
        trace, wall = traced(run, os.path.join(FLAGS.out, f"trace_layer_{tokens}.json.gz"))
        wall = wall / FLAGS.profile_steps * 1e6
        if trace is None:
            lines.append(f"T={tokens}: no trace written")
            continue
        kernels = device_time_by_kernel(trace, FLAGS.profile_steps)
        span = device_span_us(trace) / FLAGS.profile_steps
        lines.append(f"T={tokens}: GPU0 busy {sum(kernels.values()):.1f} us/call, span "
                     f"{span:.1f} us/call, wall {wall:.1f} us/call (traced, back to back), "
                     f"{len(kernels)} kernel names")
        lines += [f"    {v:8.1f} us  {k}" for k, v in kernels.most_common(FLAGS.top)]
    write_summary(lines, os.path.join(FLAGS.out, "profile_layer.txt"))


if __name__ == "__main__":
    app.run(main)

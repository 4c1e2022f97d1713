"""Per-execution layer costs for the routing-only simulation, measured on one GPU.

    JAX_PLATFORMS=cuda python benchmarks/async_ep_costs_gpu.py --out=docs/benchmarks/async_ep

Times, at every padded batch size the simulation's cost envelopes use
(`costs.fine_buckets(max_rows)`), one execution of each layer kind of the
routing-only simulation (moe_jax.async_ep.routesim) at the production shape:

* attention: one MQA-like decode block (RMSNorm, q / o projections H x H,
  one KV head of 128 for k and v, softmax attention of every row over its own
  `context` cached positions, router H x E), bf16;
* expert: one SwiGLU expert (H x 2F gate/up, F x H down) on n rows, bf16;
* sampler: final RMSNorm, LM head H x vocab and greedy argmax, bf16.

Every execution is timed as `iters` back-to-back calls of the jitted
function (inputs already on the device) and a block on the last; the median
over `reps` runs is kept. Writes async_ep_costs_<device>.json (and .md) with
date, command and commit; `async_ep_routesim_bench.py --gpu_costs=PATH`
reads it.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks.provenance import commit, portable_command, source_digest  # noqa: E402
from benchmarks.timing import median_seconds_per_call  # noqa: E402
from moe_jax.async_ep.costs import fine_buckets  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("hidden", 4096, "Model width H.")
flags.DEFINE_integer("ffn", 14336, "Expert width F.")
flags.DEFINE_integer("heads", 32, "Query heads (of 128, or hidden / heads).")
flags.DEFINE_integer("experts", 8, "Router outputs E.")
flags.DEFINE_integer("vocab", 32000, "LM head outputs.")
flags.DEFINE_integer("context", 160, "Cached positions each row attends to.")
flags.DEFINE_integer("max_rows", 2048, "Largest batch (the last bucket).")
flags.DEFINE_integer("iters", 20, "Calls per timed run.")
flags.DEFINE_integer("reps", 7, "Timed runs per bucket (the median is kept).")
flags.DEFINE_string("out", None, "Folder for the JSON and markdown (required).")
flags.DEFINE_string("tag", "", "File stem (default async_ep_costs_<device>).")

KINDS = ("attention", "expert", "sampler")


def _rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def attention(params, x, k_cache, v_cache):
    """One MQA decode block for n rows: [n, H] -> ([n, H], router logits [n, E])."""
    n, hidden = x.shape
    heads = FLAGS.heads
    head_dim = hidden // heads
    h = _rms(x)
    q = (h @ params["wq"]).reshape(n, heads, head_dim)
    k_new = h @ params["wk"]
    v_new = h @ params["wv"]
    keys = jnp.concatenate([k_cache, k_new[:, None]], axis=1)      # [n, ctx + 1, d]
    values = jnp.concatenate([v_cache, v_new[:, None]], axis=1)
    scores = jnp.einsum("nhd,ncd->nhc", q, keys, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores / jnp.sqrt(head_dim), axis=-1).astype(x.dtype)
    ctx = jnp.einsum("nhc,ncd->nhd", probs, values).reshape(n, hidden)
    y = x + ctx @ params["wo"]
    return y, _rms(y) @ params["wr"]


def expert(params, x):
    """One SwiGLU expert on n rows: [n, H] -> [n, H]."""
    gate_up = x @ params["w_gate_up"]
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ params["w_down"]


def sampler(params, x):
    """Greedy next token of n rows: [n, H] -> [n] int32."""
    return jnp.argmax(_rms(x) @ params["lm_head"], axis=-1).astype(jnp.int32)


def _params(key):
    hidden, ffn, dtype = FLAGS.hidden, FLAGS.ffn, jnp.bfloat16
    head_dim = hidden // FLAGS.heads
    shapes = {"wq": (hidden, hidden), "wk": (hidden, head_dim), "wv": (hidden, head_dim),
              "wo": (hidden, hidden), "wr": (hidden, FLAGS.experts),
              "w_gate_up": (hidden, 2 * ffn), "w_down": (ffn, hidden),
              "lm_head": (hidden, FLAGS.vocab)}
    keys = jax.random.split(key, len(shapes))
    return {name: (jax.random.normal(k, shape, jnp.float32) / shape[0] ** 0.5).astype(dtype)
            for k, (name, shape) in zip(keys, shapes.items())}


def _time(fn, *args) -> float:
    return median_seconds_per_call(fn, *args, reps=FLAGS.reps, iters=FLAGS.iters)


def measure() -> dict:
    """{kind: [seconds per bucket]} and the buckets."""
    if FLAGS.hidden % FLAGS.heads:
        raise ValueError(f"--hidden ({FLAGS.hidden}) must be a multiple of --heads ({FLAGS.heads})")
    params = _params(jax.random.key(0))
    head_dim = FLAGS.hidden // FLAGS.heads
    fns = {"attention": jax.jit(attention), "expert": jax.jit(expert), "sampler": jax.jit(sampler)}
    buckets = fine_buckets(FLAGS.max_rows)
    out = {kind: [] for kind in KINDS}
    for n in buckets:
        key = jax.random.key(n)
        x = jax.random.normal(key, (n, FLAGS.hidden), jnp.float32).astype(jnp.bfloat16)
        cache = jax.random.normal(key, (n, FLAGS.context, head_dim), jnp.float32
                                  ).astype(jnp.bfloat16)
        out["attention"].append(_time(fns["attention"], params, x, cache, cache))
        out["expert"].append(_time(fns["expert"], params, x))
        out["sampler"].append(_time(fns["sampler"], params, x))
        print(f"rows {n:5d}: " + ", ".join(f"{k} {out[k][-1] * 1e6:8.1f} us" for k in KINDS),
              flush=True)
    return {"buckets": buckets, **{f"{k}_s": v for k, v in out.items()}}


def markdown(record: dict) -> str:
    m = record["meta"]
    lines = [f"# Layer costs for the routing-only simulation, {m['device']}", "",
             f"- date: {m['date']}", f"- command: `{m['command']}`",
             f"- commit: {m['commit']}; sources {m['source_digest']}",
             f"- jax {m['jax']}; shape: `{json.dumps(m['shape'])}`",
             f"- median of {m['reps']} runs of {m['iters']} back-to-back calls", "",
             "| rows | attention us | expert us | sampler us |", "|---:|---:|---:|---:|"]
    for i, b in enumerate(record["buckets"]):
        lines.append(f"| {b} | {record['attention_s'][i] * 1e6:.1f} | "
                     f"{record['expert_s'][i] * 1e6:.1f} | {record['sampler_s'][i] * 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    if not FLAGS.out:
        raise app.UsageError("--out is required")
    device = jax.devices()[0]
    name = device.device_kind.replace(" ", "_") if device.platform != "cpu" else "cpu"
    record = measure()
    record["meta"] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=portable_command("python " + " ".join(sys.argv)), commit=commit(),
        source_digest=source_digest(), jax=jax.__version__, device=device.device_kind,
        platform=device.platform, iters=FLAGS.iters, reps=FLAGS.reps,
        shape=dict(hidden=FLAGS.hidden, ffn=FLAGS.ffn, heads=FLAGS.heads, kv_heads=1,
                   experts=FLAGS.experts, vocab=FLAGS.vocab, context=FLAGS.context,
                   max_rows=FLAGS.max_rows, dtype="bf16"))
    os.makedirs(FLAGS.out, exist_ok=True)
    stem = os.path.join(FLAGS.out, FLAGS.tag or f"async_ep_costs_{name}")
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(record))
    print(f"wrote {stem}.json")


if __name__ == "__main__":
    app.run(main)

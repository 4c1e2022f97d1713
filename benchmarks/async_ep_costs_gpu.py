"""Per-execution layer costs for the routing-only simulation, measured on one GPU.

    JAX_PLATFORMS=cuda python benchmarks/async_ep_costs_gpu.py --out=docs/benchmarks/async_ep

Times one execution of each layer kind of the routing-only simulation
(moe_jax.async_ep.routesim) at the production shape:

* attention: one MQA-like decode block (RMSNorm, q / o projections H x H,
  one KV head of 128 for k and v, softmax attention of every row over its own
  `context` cached positions, router H x E), bf16;
* expert: one SwiGLU expert (H x 2F gate/up, F x H down) on n rows, bf16,
  through moe_jax's expert FFN (`moe_jax.experts.swiglu_grouped` with one
  group; --expert_matmul, default "auto": the CUTLASS grouped GEMMs on
  Hopper GPUs, XLA elsewhere);
* sampler: final RMSNorm, LM head H x vocab and greedy argmax, bf16.

Buckets: a coarse subset of the simulation's buckets
(`costs.fine_buckets(max_rows)`): 1, 2, 4, 8, then the next fine bucket at
least --bucket_step x the last, and max_rows (--bucket_step=1.01 times every
fine bucket from 8 up). The simulation interpolates linearly between them and takes
the monotone envelope. Every timed shape compiles once (one jit per kind;
inputs are host arrays sliced to the bucket, so nothing else compiles).

Order and budget: the buckets are timed coarse-to-fine (the smallest and
the largest first, then bisection of the gaps), and the JSON and markdown
are rewritten after every bucket, marked partial until every bucket is in;
once --time_budget_s has passed no further bucket starts, and the record
stays partial (still usable: it spans 1..max_rows after two buckets).

Warm-up: before the first timed bucket, every kind runs back to back at
the largest bucket for --warmup_s seconds (a cold GPU's first buckets
otherwise read slow: its clocks are still rising).

Timing: per bucket and kind, one call compiles, one more gives a first
estimate t; a timed run is `iters` back-to-back calls (iters =
--run_s / t, clamped to [2, --iters]) and a block on the last; the median
over --reps runs is kept. Writes async_ep_costs_<device>.json (and .md)
with date, command and commit; `async_ep_routesim_bench.py --gpu_costs=PATH`
reads it.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks.provenance import commit, portable_command, source_digest  # noqa: E402
from benchmarks.timing import median_seconds_per_call  # noqa: E402
from moe_jax.async_ep.costs import fine_buckets  # noqa: E402
from moe_jax.experts import ExpertWeights, swiglu_grouped  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("hidden", 4096, "Model width H.")
flags.DEFINE_integer("ffn", 14336, "Expert width F.")
flags.DEFINE_integer("heads", 32, "Query heads (of 128, or hidden / heads).")
flags.DEFINE_integer("experts", 8, "Router outputs E.")
flags.DEFINE_integer("vocab", 32000, "LM head outputs.")
flags.DEFINE_enum("expert_matmul", "auto", ["auto", "cutlass", "xla"],
                  "The expert FFN's grouped matmuls (MoEConfig.matmul).")
flags.DEFINE_integer("context", 160, "Cached positions each row attends to.")
flags.DEFINE_integer("max_rows", 2048, "Largest batch (the last bucket).")
flags.DEFINE_float("bucket_step", 1.5, "Timed buckets: the next fine bucket at least this "
                   "factor above the last (1.01: every fine bucket from 8 up).")
flags.DEFINE_integer("iters", 20, "Most calls per timed run.")
flags.DEFINE_float("run_s", 0.01, "Target seconds per timed run (sets the calls per run).")
flags.DEFINE_integer("reps", 7, "Timed runs per bucket and kind (the median is kept).")
flags.DEFINE_float("time_budget_s", 100.0, "No bucket starts after this many seconds; the "
                   "record then stays partial.")
flags.DEFINE_float("warmup_s", 3.0, "Seconds of back-to-back calls at the largest bucket "
                   "before any timing (clocks and caches up; not counted in the budget).")
flags.DEFINE_string("out", None, "Folder for the JSON and markdown (required).")
flags.DEFINE_string("tag", "", "File stem (default async_ep_costs_<device>).")

KINDS = ("attention", "expert", "sampler")


def timed_buckets(max_rows: int, step: float) -> list[int]:
    """1, 2, 4, 8 (up to max_rows), then the next of `fine_buckets(max_rows)`
    at least `step` x the last, and max_rows."""
    if not step > 1.0:
        raise ValueError(f"step must be > 1, got {step!r}")
    fine = fine_buckets(max_rows)
    out = [b for b in (1, 2, 4, 8) if b <= max_rows]
    for b in fine:
        if b > out[-1] and b >= out[-1] * step:
            out.append(b)
    if out[-1] != max_rows:
        out.append(max_rows)
    return out


def coarse_to_fine(n: int) -> list[int]:
    """Indices 0..n-1: first and last, then the middles of the gaps, breadth first."""
    if n <= 2:
        return list(range(n))
    order, gaps = [0, n - 1], [(0, n - 1)]
    while gaps:
        nxt = []
        for lo, hi in gaps:
            if hi - lo > 1:
                mid = (lo + hi) // 2
                order.append(mid)
                nxt += [(lo, mid), (mid, hi)]
        gaps = nxt
    return order


def _rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def attention(params, x, k_cache, v_cache):
    """One MQA decode block for n rows: [n, H] -> ([n, H], router logits [n, E])."""
    n, hidden = x.shape
    head_dim = k_cache.shape[-1]
    heads = hidden // head_dim
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


def expert(params, x, matmul="auto"):
    """One SwiGLU expert on n rows through the library's expert FFN: [n, H] -> [n, H]."""
    group_sizes = jnp.full((1,), x.shape[0], jnp.int32)
    weights = ExpertWeights(params["w_gate_up"][None], params["w_down"][None])
    return swiglu_grouped(x, group_sizes, weights, compute_dtype=x.dtype, matmul=matmul)


def sampler(params, x):
    """Greedy next token of n rows: [n, H] -> [n] int32."""
    return jnp.argmax(_rms(x) @ params["lm_head"], axis=-1).astype(jnp.int32)


def _host_normal(rng, shape, scale=1.0):
    return (rng.standard_normal(shape, np.float32) * scale).astype(jnp.bfloat16)


def _params(rng):
    """Weights on the device, drawn on the host (no per-shape device RNG compiles)."""
    hidden, ffn = FLAGS.hidden, FLAGS.ffn
    head_dim = hidden // FLAGS.heads
    shapes = {"wq": (hidden, hidden), "wk": (hidden, head_dim), "wv": (hidden, head_dim),
              "wo": (hidden, hidden), "wr": (hidden, FLAGS.experts),
              "w_gate_up": (hidden, 2 * ffn), "w_down": (ffn, hidden),
              "lm_head": (hidden, FLAGS.vocab)}
    return {name: jax.device_put(_host_normal(rng, shape, shape[0] ** -0.5))
            for name, shape in shapes.items()}


def _time(fn, *args) -> float:
    """Median seconds per call (see the module docstring)."""
    jax.block_until_ready(fn(*args))            # compiles
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    iters = max(2, min(FLAGS.iters, int(math.ceil(FLAGS.run_s / max(first, 1e-9)))))
    return median_seconds_per_call(fn, *args, reps=FLAGS.reps, iters=iters)


def record_of(planned, done: dict, meta: dict) -> dict:
    """The record from the buckets timed so far ({bucket: {kind: s}})."""
    buckets = sorted(done)
    meta = dict(meta, complete=len(done) == len(planned), measured=len(done),
                planned_buckets=list(planned))
    return {"buckets": buckets, **{f"{k}_s": [done[b][k] for b in buckets] for k in KINDS},
            "meta": meta}


def markdown(record: dict) -> str:
    m = record["meta"]
    title = f"# Layer costs for the routing-only simulation, {m['device']}"
    if not m["complete"]:
        title += " (PARTIAL)"
    lines = [title, ""]
    if not m["complete"]:
        lines += [f"**Partial record**: {m['measured']} of {len(m['planned_buckets'])} planned "
                  f"buckets timed ({m['stopped']}).", ""]
    lines += [f"- date: {m['date']}", f"- command: `{m['command']}`",
              f"- commit: {m['commit']}; sources {m['source_digest']}",
              f"- jax {m['jax']}; shape: `{json.dumps(m['shape'])}`; expert FFN: "
              f"`swiglu_grouped(matmul={m.get('expert_matmul', 'auto')!r})`, one group",
              f"- median of {m['reps']} runs of up to {m['iters']} back-to-back calls "
              f"(about {m['run_s'] * 1e3:g} ms per run); buckets timed coarse to fine, "
              f"the simulation interpolates between them; {m.get('warmup_s', 0):g} s of "
              f"warm-up at the largest bucket first",
              f"- wall time {m['elapsed_s']:.0f} s (budget {m['time_budget_s']:g} s)", "",
              "| rows | attention us | expert us | sampler us |", "|---:|---:|---:|---:|"]
    for i, b in enumerate(record["buckets"]):
        lines.append(f"| {b} | {record['attention_s'][i] * 1e6:.1f} | "
                     f"{record['expert_s'][i] * 1e6:.1f} | {record['sampler_s'][i] * 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def write(stem: str, record: dict):
    for ext, text in ((".json", json.dumps(record, indent=1)), (".md", markdown(record))):
        tmp = stem + ext + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, stem + ext)


def main(argv):
    del argv
    start = time.perf_counter()
    if not FLAGS.out:
        raise app.UsageError("--out is required")
    if FLAGS.hidden % FLAGS.heads:
        raise app.UsageError(f"--hidden ({FLAGS.hidden}) must be a multiple of --heads "
                             f"({FLAGS.heads})")
    device = jax.devices()[0]
    name = device.device_kind.replace(" ", "_") if device.platform != "cpu" else "cpu"
    os.makedirs(FLAGS.out, exist_ok=True)
    stem = os.path.join(FLAGS.out, FLAGS.tag or f"async_ep_costs_{name}")
    planned = timed_buckets(FLAGS.max_rows, FLAGS.bucket_step)
    head_dim = FLAGS.hidden // FLAGS.heads
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=portable_command("python " + " ".join(sys.argv)), commit=commit(),
        source_digest=source_digest(), jax=jax.__version__, device=device.device_kind,
        platform=device.platform, iters=FLAGS.iters, reps=FLAGS.reps, run_s=FLAGS.run_s,
        bucket_step=FLAGS.bucket_step, time_budget_s=FLAGS.time_budget_s,
        warmup_s=FLAGS.warmup_s, expert_matmul=FLAGS.expert_matmul,
        shape=dict(hidden=FLAGS.hidden, ffn=FLAGS.ffn, heads=FLAGS.heads, kv_heads=1,
                   experts=FLAGS.experts, vocab=FLAGS.vocab, context=FLAGS.context,
                   max_rows=FLAGS.max_rows, dtype="bf16"))
    rng = np.random.default_rng(0)
    params = _params(rng)
    x_all = _host_normal(rng, (FLAGS.max_rows, FLAGS.hidden))
    cache_all = _host_normal(rng, (FLAGS.max_rows, FLAGS.context, head_dim))
    fns = {"attention": jax.jit(attention),
           "expert": jax.jit(functools.partial(expert, matmul=FLAGS.expert_matmul)),
           "sampler": jax.jit(sampler)}
    warm_x = jax.device_put(x_all)
    warm_cache = jax.device_put(cache_all)
    warm_start = time.perf_counter()
    while time.perf_counter() - warm_start < FLAGS.warmup_s:
        jax.block_until_ready([fns["attention"](params, warm_x, warm_cache, warm_cache),
                               fns["expert"](params, warm_x), fns["sampler"](params, warm_x)])
    del warm_x, warm_cache
    start += time.perf_counter() - warm_start
    done: dict = {}
    stopped = "in progress"
    for i in coarse_to_fine(len(planned)):
        if time.perf_counter() - start > FLAGS.time_budget_s:
            stopped = f"time budget {FLAGS.time_budget_s:g} s reached"
            break
        n = planned[i]
        x = jax.device_put(x_all[:n])
        cache = jax.device_put(cache_all[:n])
        t0 = time.perf_counter()
        done[n] = {"attention": _time(fns["attention"], params, x, cache, cache),
                   "expert": _time(fns["expert"], params, x),
                   "sampler": _time(fns["sampler"], params, x)}
        del x, cache
        elapsed = time.perf_counter() - start
        print(f"rows {n:5d} ({time.perf_counter() - t0:5.1f} s, total {elapsed:5.1f} s): "
              + ", ".join(f"{k} {done[n][k] * 1e6:8.1f} us" for k in KINDS), flush=True)
        write(stem, record_of(planned, done, dict(meta, elapsed_s=elapsed, stopped=stopped)))
    record = record_of(planned, done, dict(meta, elapsed_s=time.perf_counter() - start,
                                           stopped=stopped))
    write(stem, record)
    print(f"wrote {stem}.json ({'complete' if record['meta']['complete'] else 'PARTIAL'}, "
          f"{len(done)} of {len(planned)} buckets, {record['meta']['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    app.run(main)

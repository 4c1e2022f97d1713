"""What row invariance costs: moe_jax_row_matmul against lax.ragged_dot.

    python -m benchmarks.row_matmul_bench [--shapes=M:K:N:G,...] [--dtypes=bfloat16,float32]

Times the grouped matmul of MoEConfig.matmul="row_invariant"
(`moe_jax.row_invariant.grouped_matmul`) and of matmul="xla"
(`lax.ragged_dot`, float32 accumulation) on the same fresh random inputs,
groups of equal size, in one jitted loop of --calls calls per measured step
(so dispatch overhead is amortized), on the first device of the default
backend. Writes JSON and a markdown table to --out (device, versions, date,
command).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.provenance import commit, extension_digest, portable_command, source_digest
from moe_jax import cli
from moe_jax import row_invariant

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["1:2048:2048:1", "8:4096:14336:2", "128:2048:8192:1",
                             "512:4096:14336:2", "2048:4096:14336:2", "64:256:512:2",
                             "512:256:512:8"],
                  "M:K:N:G (rows, depth, columns, groups) per case.")
flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "Input dtypes.")
flags.DEFINE_integer("calls", 10, "Matmuls per measured step (one jitted loop).")
flags.DEFINE_integer("steps", 20, "Measured steps per case.")
flags.DEFINE_integer("warmup", 3, "Unmeasured steps first.")
flags.DEFINE_string("out", None, "Folder for the JSON and markdown. Required: the records under docs/benchmarks/ are only written when named.")
flags.DEFINE_string("tag", "", "File stem (default row_matmul_<device>).")

METHODS = {
    "row_invariant": lambda x, w, sizes: row_invariant.grouped_matmul(x, w, sizes),
    "ragged_dot": lambda x, w, sizes: jax.lax.ragged_dot(
        x, w, sizes, preferred_element_type=jnp.float32),
}


def _loop(method, calls):
    """calls chained matmuls (each input nudged by the last output, so none is
    hoisted or merged); returns a scalar that depends on all of them."""
    fn = METHODS[method]

    def run(x, w, sizes):
        def body(_, carry):
            acc, xi = carry
            y = fn(xi, w, sizes)
            return acc + y[0, 0], xi + (y[:, :1] * 0).astype(xi.dtype)
        acc, _ = jax.lax.fori_loop(0, calls, body, (jnp.float32(0), x))
        return acc

    return jax.jit(run)


def _case(m, k, n, g, dtype, rng):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((g, k, n)) * k ** -0.5, dtype)
    sizes = np.full(g, m // g, np.int32)
    sizes[-1] += m - sizes.sum()
    return x, w, jnp.asarray(sizes)


def _relative_difference(x, w, sizes) -> float:
    """||row_invariant - ragged_dot|| / ||ragged_dot|| of one call: both
    methods compute the same product (to rounding)."""
    a, b = (np.asarray(jax.jit(METHODS[m])(x, w, sizes), np.float64) for m in METHODS)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _time(fn, args) -> list[float]:
    for _ in range(FLAGS.warmup):
        fn(*args).block_until_ready()
    times = []
    for _ in range(FLAGS.steps):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append((time.perf_counter() - start) / FLAGS.calls)
    return times


def measure() -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for shape in FLAGS.shapes:
        m, k, n, g = (int(v) for v in shape.split(":"))
        for dtype_name in FLAGS.dtypes:
            args = _case(m, k, n, g, jnp.dtype(dtype_name), rng)
            row = dict(m=m, k=k, n=n, groups=g, dtype=dtype_name,
                       rel_diff=_relative_difference(*args))
            for method in METHODS:
                times = _time(_loop(method, FLAGS.calls), args)
                median = statistics.median(times)
                row[f"{method}_us"] = median * 1e6
                row[f"{method}_tflops"] = 2 * m * k * n / median / 1e12
            row["slowdown"] = row["row_invariant_us"] / row["ragged_dot_us"]
            rows.append(row)
            print(f"M={m} K={k} N={n} G={g} {dtype_name}: row_invariant "
                  f"{row['row_invariant_us']:.1f} us, ragged_dot {row['ragged_dot_us']:.1f} us "
                  f"({row['slowdown']:.2f}x)", flush=True)
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Row-invariant grouped matmul vs lax.ragged_dot: {meta['device']}", "",
             f"- date: {meta['date']}", f"- command: `{portable_command(meta['command'])}`",
             f"- jax {meta['jax']}, Python {meta['python']}, sources {meta['source_digest']}",
             f"- median over {meta['steps']} steps of {meta['calls']} chained calls in one "
             "jitted loop; float32 accumulation and output in both; equal group sizes", "",
             "| M | K | N | G | dtype | row_invariant (us) | TFLOP/s | ragged_dot (us) | TFLOP/s "
             "| row_invariant / ragged_dot | relative difference |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['m']} | {r['k']} | {r['n']} | {r['groups']} | {r['dtype']} | "
                     f"{r['row_invariant_us']:.1f} | {r['row_invariant_tflops']:.2f} | "
                     f"{r['ragged_dot_us']:.1f} | {r['ragged_dot_tflops']:.2f} | "
                     f"{r['slowdown']:.2f}x | {r['rel_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    if not FLAGS.out:
        raise app.UsageError("--out is required (the folder for the results)")
    device = jax.devices()[0]
    meta = dict(device=device.device_kind, platform=device.platform,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python -m benchmarks.row_matmul_bench " + " ".join(sys.argv[1:]),
                jax=jax.__version__, python=platform.python_version(),
                source_digest=source_digest(), commit=commit(),
                extension_sha256=extension_digest(), steps=FLAGS.steps, calls=FLAGS.calls)
    rows = measure()
    tag = FLAGS.tag or "row_matmul_" + device.device_kind.replace(" ", "_")
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, tag + ".json"), "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=1)
    with open(os.path.join(FLAGS.out, tag + ".md"), "w") as f:
        f.write(markdown(meta, rows))
    print(f"wrote {FLAGS.out}/{tag}.json and .md")


if __name__ == "__main__":
    cli.run(main)

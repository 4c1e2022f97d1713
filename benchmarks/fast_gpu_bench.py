"""Staged (FAST) all-to-all vs padded lax.all_to_all and lax.ragged_all_to_all.

    python -m benchmarks.fast_gpu_bench                       # all local GPUs
    python -m benchmarks.fast_gpu_bench --platform=cpu --cpu_devices=4 \\
        --sizes=64 --hidden=64 --steps=5 --out=OUT_DIR   # dry run

Every method performs the same ragged all-to-all (rows grouped by
destination in, rows grouped by source out, the same bytes) under jit over
one mesh axis of all local devices, with the P x P counts drawn from a
Zipf-skewed traffic model (moe_jax.fast.workloads.zipf_matrix) and
all-gathered inside the step:

  padded              lax.all_to_all of [P, C, H] blocks, C = the largest
                      count of any matrix (pack and unpack included)
  ragged              lax.ragged_all_to_all (GPU; on CPU moe_jax's CPU
                      all-to-all custom call stands in)
  staged:cc:NxM       the FAST schedule on N (emulated) servers of M GPUs,
                      one CUDA custom call (host schedule + NCCL send/recv)
  staged:cb:NxM       the same schedule through jax.pure_callback and one
                      ragged all-to-all per phase
  ("auto" for NxM: the topology nvidia-smi topo -m gives.)

Each method's output is checked bit for bit against the direct reference
before it is timed.  Per size: `--matrices` distinct matrices cycled over
`--steps` synchronous steps after `--warmup`; mean, median, p95 and p99 of
the host-timed step latency.  Writes <out>/<tag>.json and <tag>.md.
"""

from __future__ import annotations

import datetime
import json
import os
import platform as platform_mod
import socket
import sys
import time

from absl import app, flags

from benchmarks.provenance import code_meta, portable_command
from moe_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["1024", "4096", "16384"],
                  "Mean rows each GPU sends (matrix mean entry x P).")
flags.DEFINE_integer("hidden", 4096, "Row width H (elements).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Row dtype.")
flags.DEFINE_float("skew", 0.9, "Zipf skewness of the traffic matrices.")
flags.DEFINE_enum("scope", "global", ["global", "row"], "zipf_matrix scope.")
flags.DEFINE_list("methods", ["padded", "ragged", "staged:cc:auto", "staged:cc:2x2",
                              "staged:cc:4x1", "staged:cb:2x2"],
                  "Methods to time (see the module docstring).")
flags.DEFINE_integer("matrices", 10, "Distinct traffic matrices per size.")
flags.DEFINE_integer("steps", 100, "Measured steps per method and size.")
flags.DEFINE_integer("warmup", 5, "Unmeasured steps first.")
flags.DEFINE_integer("seed", 0, "Matrix seed.")
flags.DEFINE_enum("platform", "auto", ["auto", "gpu", "cpu"],
                  "auto: GPUs when there are any, else CPU devices.")
flags.DEFINE_integer("cpu_devices", 4, "Emulated CPU devices (--platform=cpu).")
flags.DEFINE_string("out", None, "Folder for the JSON and markdown. Required: the records under docs/benchmarks/ are only written when named.")
flags.DEFINE_string("tag", "", "File stem (default fast_gpu_<P>x<device>).")
flags.DEFINE_float("time_budget_s", 900, "Stop starting new measurements after this.")


def _setup_platform():
  """Chooses the platform before JAX starts its backends."""
  if FLAGS.platform == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
    want = f"--xla_force_host_platform_device_count={FLAGS.cpu_devices}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + want).strip()
  import jax  # noqa: PLC0415
  if FLAGS.platform == "auto":
    try:
      return jax.devices("gpu"), "gpu"
    except RuntimeError:
      return jax.devices("cpu"), "cpu"
  return jax.devices(FLAGS.platform), FLAGS.platform


def _matrices(ranks, size, rng):
  from moe_jax.fast import workloads  # noqa: PLC0415
  return [workloads.zipf_matrix(rng, ranks, FLAGS.skew, mean=size / ranks,
                                scope=FLAGS.scope) for _ in range(FLAGS.matrices)]


def _build(method, mesh, rows, out_rows, cap, plat):
  """jit(shard_map): (x [P*R, H], counts [P*P]) -> out [P*R_out, H]."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  from moe_jax import custom_calls  # noqa: PLC0415
  from moe_jax.fast import staged  # noqa: PLC0415

  ranks = mesh.shape["ep"]

  def traffic_of(counts):
    return staged.effective_traffic(jax.lax.all_gather(counts, "ep"), rows, out_rows)

  def padded(x, counts):
    t = traffic_of(counts)
    me = jax.lax.axis_index("ep")
    send_off = jnp.cumsum(t[me]) - t[me]
    j = jnp.arange(cap)
    idx = jnp.clip(send_off[:, None] + j[None, :], 0, rows - 1)        # [P, C]
    blocks = jnp.where((j[None, :] < t[me][:, None])[..., None], x[idx], 0)
    recv = jax.lax.all_to_all(blocks, "ep", 0, 0, tiled=False)         # [P, C, H]
    got = t[:, me]
    end = jnp.cumsum(got)
    i = jnp.arange(out_rows)
    src = jnp.minimum(jnp.searchsorted(end, i, side="right"), ranks - 1)
    row = jnp.clip(i - (end[src] - got[src]), 0, cap - 1)
    return jnp.where((i < end[-1])[:, None], recv[src, row], 0)

  def ragged(x, counts):
    t = traffic_of(counts)
    me = jax.lax.axis_index("ep")
    send_off = (jnp.cumsum(t[me]) - t[me]).astype(jnp.int32)
    recv_off = (jnp.cumsum(t, axis=0) - t).astype(jnp.int32)           # [src, dst]
    if plat == "cpu":
      out, _ = custom_calls.ragged_all_to_all(
          x, send_off, t[me].astype(jnp.int32), recv_off[:, me], recv_rows=out_rows,
          axis_name="ep")
      return out
    return jax.lax.ragged_all_to_all(
        x, jnp.zeros((out_rows, x.shape[1]), x.dtype), send_off, t[me].astype(jnp.int32),
        recv_off[me], t[:, me].astype(jnp.int32), axis_name="ep")

  def reference(x, counts):
    return staged.reference_all_to_all(x, counts, axis_name="ep", out_rows=out_rows)[0]

  def staged_fn(impl, topo):
    def run(x, counts):
      return staged.staged_all_to_all(
          x, counts, axis_name="ep", topology=None if topo == "auto" else topo,
          out_rows=out_rows, impl=impl, platform=plat)[0]
    return run

  if method == "padded":
    body = padded
  elif method == "ragged":
    body = ragged
  elif method == "reference":
    body = reference
  elif method.startswith("staged:"):
    _, kind, topo = method.split(":")
    body = staged_fn({"cc": "custom_call", "cb": "callback"}[kind], topo)
  else:
    raise ValueError(f"unknown method {method!r}")
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")),
                               out_specs=P("ep")))


def _time(fn, inputs):
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  for i in range(FLAGS.warmup):
    jax.block_until_ready(fn(*inputs[i % len(inputs)]))
  lat = []
  for i in range(FLAGS.steps):
    args = inputs[i % len(inputs)]
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    lat.append((time.perf_counter() - t0) * 1e6)
  lat = np.asarray(lat)
  return dict(mean_us=float(lat.mean()), median_us=float(np.median(lat)),
              p95_us=float(np.percentile(lat, 95)), p99_us=float(np.percentile(lat, 99)),
              samples_us=[round(float(v), 1) for v in lat])


def _plan_stats(mats, topo, rows, out_rows):
  """Mean phases and workspace rows of the FAST plans of these matrices."""
  import numpy as np  # noqa: PLC0415

  from moe_jax.fast import cpp, plan as pl  # noqa: PLC0415
  phases, ws = [], []
  for m in mats:
    t = pl.effective_traffic(m, rows, out_rows)
    p = (cpp.execution_plan if cpp.available() else pl.execution_plan)(
        t, topo.num_servers, topo.gpus_per_server)
    phases.append(p.num_phases)
    ws.append(int(p.workspace_used.max(initial=0)))
  return dict(plan_phases_mean=float(np.mean(phases)),
              plan_workspace_rows_max=int(max(ws)),
              workspace_rows_allocated=pl.workspace_rows(rows, out_rows, topo.num_servers,
                                                                 topo.gpus_per_server))


def _meta(devices, plat, detected):
  import jax  # noqa: PLC0415

  import moe_jax as mj  # noqa: PLC0415
  nccl = None
  if plat == "gpu":
    try:
      from moe_jax import _ffi_cuda  # noqa: PLC0415
      nccl = _ffi_cuda.nccl_info() if getattr(_ffi_cuda, "with_nccl", False) else None
    except ImportError:
      pass
  return dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      command="python -m benchmarks.fast_gpu_bench " + " ".join(sys.argv[1:]),
      host=socket.gethostname(), platform=plat,
      devices=f"{len(devices)} x {devices[0].device_kind}", jax=jax.__version__,
      moe_jax=mj.__version__, **code_meta(),
      python=platform_mod.python_version(), nccl=nccl,
      detected_topology=f"{detected} ({detected.source}{': ' + detected.detail if detected.detail else ''})",
      hidden=FLAGS.hidden, dtype=FLAGS.dtype, skew=FLAGS.skew, scope=FLAGS.scope,
      matrices=FLAGS.matrices, steps=FLAGS.steps, warmup=FLAGS.warmup,
      xla_flags=os.environ.get("XLA_FLAGS", ""))


def write_markdown(data: dict, path: str) -> None:
  """The results as markdown tables, one per size."""
  from benchmarks.report import _fmt  # noqa: PLC0415
  meta, results = data["meta"], data["results"]
  lines = [f"# Staged (FAST) all-to-all vs padded and ragged: {meta['devices']}", "",
           f"- date: {meta['date']}", f"- command: `{portable_command(meta['command'])}`",
           f"- jax {meta['jax']}, moe_jax {meta['moe_jax']} (sources "
           f"{meta['moe_jax_source_sha256']}), Python {meta['python']}, NCCL "
           f"{(meta.get('nccl') or {}).get('version', 'n/a')}",
           f"- rows of H={meta['hidden']} {meta['dtype']}; Zipf skew {meta['skew']} "
           f"({meta['scope']}), {meta['matrices']} matrices cycled, "
           f"{meta['steps']} measured steps after {meta['warmup']} warm-up",
           f"- detected topology: {meta['detected_topology']}",
           f"- XLA_FLAGS: `{meta['xla_flags'] or '(none)'}`", "",
           "Latency in microseconds per step, timed on the host around a synchronous "
           "call (JAX dispatch included). Every step all-gathers the counts. "
           "`exact`: output bitwise equal to the direct reference before timing. "
           "`vs padded` / `vs ragged`: that method's median / this one's (above 1: "
           "faster). `GB/s`: mean bytes each GPU sends to other GPUs / median. "
           "`phases`: mean FAST phases per plan (NCCL groups per call).", ""]
  for size in sorted({r["size"] for r in results}):
    rows = [r for r in results if r["size"] == size]
    first = rows[0]
    lines += [f"## {size} rows per GPU on average (x: {first['rows_in']} rows, out: "
              f"{first['rows_out']}, padded C = {first['padded_capacity']})", "",
              "| method | mean | median | p95 | p99 | vs padded | vs ragged | GB/s | "
              "phases | exact |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = {r["method"]: r["median_us"] for r in rows if "median_us" in r}
    for r in rows:
      if "error" in r:
        lines.append(f"| {r['method']} | failed: {r['error'][:100]} | | | | | | | | |")
        continue

      def ratio(name):
        b = base.get(name)
        return None if b is None else b / r["median_us"]

      gbps = r["bytes_sent_per_gpu"] / (r["median_us"] * 1e-6) / 1e9
      lines.append(
          f"| {r['method']} | {_fmt(r['mean_us'])} | {_fmt(r['median_us'])} | "
          f"{_fmt(r['p95_us'])} | {_fmt(r['p99_us'])} | {_fmt(ratio('padded'), 2)}x | "
          f"{_fmt(ratio('ragged'), 2)}x | {_fmt(gbps, 2)} | "
          f"{_fmt(r.get('plan_phases_mean'))} | {r['exact']} |")
    lines.append("")
  with open(path, "w") as f:
    f.write("\n".join(lines))


def main(argv):
  del argv
  if not FLAGS.out:
    raise app.UsageError("--out is required (the folder for the results)")
  devices, plat = _setup_platform()
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  from moe_jax.fast import plan as pl  # noqa: PLC0415
  from moe_jax.fast import topology as tp  # noqa: PLC0415

  start = time.time()
  ranks = len(devices)
  mesh = jax.make_mesh((ranks,), ("ep",), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))
  detected = (tp.detect_topology(ranks) if plat == "gpu"
              else tp.Topology(1, ranks, "default", "CPU devices"))
  print(f"{ranks} x {devices[0].device_kind}; detected topology {detected} "
        f"({detected.source})", flush=True)
  dtype = jnp.dtype(FLAGS.dtype)
  shard = NamedSharding(mesh, P("ep"))
  rng = np.random.default_rng(FLAGS.seed)
  results = []
  tag = FLAGS.tag or f"fast_gpu_{ranks}x{devices[0].device_kind.replace(' ', '_')}"
  os.makedirs(FLAGS.out, exist_ok=True)
  json_path = os.path.join(FLAGS.out, tag + ".json")
  stopped = False
  for size in map(int, FLAGS.sizes):
    mats = _matrices(ranks, size, rng)
    rows = int(max(m.sum(1).max() for m in mats))
    out_rows = int(max(m.sum(0).max() for m in mats))
    cap = int(max(m.max() for m in mats))
    sent = float(np.mean([(m.sum() - np.trace(m)) / ranks for m in mats]))
    x = jax.device_put(jax.random.normal(jax.random.key(1), (ranks * rows, FLAGS.hidden),
                                         jnp.float32).astype(dtype), shard)
    inputs = [(x, jax.device_put(jnp.asarray(m.reshape(-1), jnp.int32), shard))
              for m in mats]
    reference = _build("reference", mesh, rows, out_rows, cap, plat)
    want = jax.block_until_ready(reference(*inputs[0]))
    same = jax.jit(lambda a, b: jnp.array_equal(
        jax.lax.bitcast_convert_type(a, jnp.uint16 if a.dtype.itemsize == 2 else jnp.uint32),
        jax.lax.bitcast_convert_type(b, jnp.uint16 if b.dtype.itemsize == 2 else jnp.uint32)))
    for method in FLAGS.methods:
      if time.time() - start > FLAGS.time_budget_s:
        print("time budget reached; stopping", flush=True)
        stopped = True
        break
      row = dict(size=size, method=method, rows_in=rows, rows_out=out_rows,
                 padded_capacity=cap, bytes_sent_per_gpu=sent * FLAGS.hidden * dtype.itemsize)
      try:
        if method.startswith("staged:"):
          topo = method.split(":")[2]
          topo = detected if topo == "auto" else tp.Topology.parse(topo)
          if topo.num_gpus != ranks:
            raise ValueError(f"topology {topo} does not fit {ranks} devices")
          row.update(topology=str(topo), **_plan_stats(mats, topo, rows, out_rows))
        fn = _build(method, mesh, rows, out_rows, cap, plat)
        row["exact"] = bool(same(jax.block_until_ready(fn(*inputs[0])), want))
        row.update(_time(fn, inputs))
      except Exception as err:  # recorded, not fatal: one method may not run here
        print(f"size={size} {method}: FAILED {type(err).__name__}: {str(err)[:300]}",
              flush=True)
        row["error"] = f"{type(err).__name__}: {err}"[:2000]
        results.append(row)
        continue
      results.append(row)
      print(f"size={size:6d} {method:18s} exact={row['exact']} mean {row['mean_us']:9.1f} "
            f"median {row['median_us']:9.1f} p95 {row['p95_us']:9.1f} us", flush=True)
    if stopped:
      break
  data = dict(meta=dict(_meta(devices, plat, detected), partial=stopped), results=results)
  with open(json_path, "w") as f:
    json.dump(data, f, indent=1)
  md_path = json_path[:-len(".json")] + ".md"
  write_markdown(data, md_path)
  print(f"wrote {json_path} and {md_path}", flush=True)
  if any(r.get("exact") is False for r in results):
    print("NOT EXACT: some method differs from the reference", flush=True)
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)

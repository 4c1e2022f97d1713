"""FAST all-to-all(v) scheduler: C++ runtime and simulated completion time.

    python benchmarks/fast_bench.py
    python benchmarks/fast_bench.py --runtime_gpus=16,32,64 --sim_gpus=32,64
    python benchmarks/fast_bench.py --sim_gpus=   # the runtime table alone

Part 1 times ``moe_jax._fast`` (C++ scheduler, buffers reused between runs as
in a serving loop) at 8 GPUs per server on uniform and Zipf matrices: the
median over fresh matrices of the per-run wall time, for the server-level
schedule only (padding + Birkhoff-von Neumann + per-stage sizes), for one
GPU's schedule, for the full schedule (every transfer with its original
flow; in the ranges form and written out as rows, on the same and on
distinct matrices, warm and cold), and for what the CUDA custom call computes per call on one rank
(StagedPlanner: traffic check, schedule, plan, the rank's program), from the
rank's per-GPU schedule and through the whole plan, next to the FAST paper's
numbers (Xeon Platinum 8468; NSDI '26, section 4.4 / Figure 16).

Part 2 simulates (moe_jax.fast.simulator, alpha-beta per link) FAST,
SpreadOut and a direct all-to-all against the paper's bound (infinitely fast
scale-up) and the two-tier bound (scale-up ports too) from 32 to 320 GPUs,
50 MB per GPU pair on average as in the paper's Figure 17a, H200 NVLink
(450 GB/s) + 400G InfiniBand (50 GB/s).

Writes <out>/fast_scheduler.{json,md} and fast_simulation.{json,md,png}.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time

import numpy as np
from absl import app, flags

from benchmarks.provenance import code_meta, portable_command
from moe_jax import cli

from moe_jax.fast import cpp
from moe_jax.fast import simulator as sim
from moe_jax.fast import workloads

FLAGS = flags.FLAGS
flags.DEFINE_list("runtime_gpus", ["16", "32", "64", "96", "128", "320"],
                  "GPU counts for the scheduler runtime (8 per server).")
flags.DEFINE_list("sim_gpus", ["32", "64", "96", "128", "192", "256", "320"],
                  "GPU counts for the simulation (8 per server); empty: no "
                  "simulation.")
flags.DEFINE_integer("gpus_per_server", 8, "GPUs per server.")
flags.DEFINE_integer("whole_plan_max_gpus", 96,
                     "Largest GPU count at which the rank program is also "
                     "timed through the whole plan (slow above).")
flags.DEFINE_integer("matrices", 5, "Fresh matrices per runtime configuration.")
flags.DEFINE_integer("distinct_matrices", 30,
                     "Matrices per runtime configuration for the full "
                     "schedule timed once per matrix (warm and cold).")
flags.DEFINE_float("seconds_per_config", 1.5,
                   "Approximate timing budget per runtime configuration.")
flags.DEFINE_integer("max_repeats", 2000, "Most timed runs per matrix.")
flags.DEFINE_float("mean_bytes", 50e6, "Mean bytes per GPU pair (simulation).")
flags.DEFINE_float("zipf_skew", 0.9, "Zipf skewness.")
flags.DEFINE_integer("seed", 0, "Matrix seed.")
flags.DEFINE_string("device_label", "2-core CPU", "How to name the CPU.")
flags.DEFINE_list("executed_shapes", ["4x8", "8x8", "40x8"],
                  "servers x GPUs for the executed-plan table; empty: none.")
flags.DEFINE_integer("executed_seeds", 10, "Matrices (seeds) per executed-plan "
                     "configuration.")
flags.DEFINE_integer("search_max_servers", 8,
                     "Largest server count at which the executed-plan table "
                     "also runs the simulator's layout search (slow above).")
flags.DEFINE_string("suffix", "", "Appended to the output file stems "
                    "(`_cpu` for the records under docs/benchmarks/fast/).")
flags.DEFINE_string("out", None, "Output folder. Required: the records under docs/benchmarks/ are only written when named.")

# FAST paper (NSDI '26), section 4.4 and Figure 16, 8 GPUs per server.
PAPER_US = {16: 3.1, 32: 25.0, 64: 221.0, 96: 805.0, 320: 77_000.0}


def _workload(rng, kind, g, mean):
  if kind == "uniform":
    return workloads.uniform_matrix(rng, g, mean)
  if kind == "zipf":
    return workloads.zipf_matrix(rng, g, FLAGS.zipf_skew, mean)
  if kind == "zipf_row":
    return workloads.zipf_matrix(rng, g, FLAGS.zipf_skew, mean, scope="row")
  raise ValueError(kind)


def _meta(extra):
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  import jax
  return dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      command=portable_command("python " + " ".join(sys.argv)),
      device=f"{FLAGS.device_label} ({cpu}, {os.cpu_count()} logical cores)",
      python=platform.python_version(), numpy=np.__version__,
      jax=jax.__version__, **extra)


def _time(timer, mats):
  """Median and spread (us) of timer(matrix, repeats) over the matrices,
  repeats calibrated so that all of them take about the budget."""
  t0 = time.perf_counter()
  timer(mats[0], 1)
  one = max(time.perf_counter() - t0, 1e-7)
  reps = int(np.clip(FLAGS.seconds_per_config / 2 / len(mats) / one, 5,
                     FLAGS.max_repeats))
  samples = np.concatenate([timer(t, reps) for t in mats]) / 1e3
  return dict(median_us=float(np.median(samples)),
              p10_us=float(np.percentile(samples, 10)),
              p90_us=float(np.percentile(samples, 90)),
              runs=int(samples.size))


def _each(each, n, m, **kw):
  samples = cpp.time_schedule_each(each, n, m, **kw) / 1e3
  return dict(median_us=float(np.median(samples)),
              p90_us=float(np.percentile(samples, 90)),
              runs=int(samples.size))


def run_runtime(rng):
  m = FLAGS.gpus_per_server
  results = []
  for g in map(int, FLAGS.runtime_gpus):
    n = g // m
    for kind in ("uniform", "zipf"):
      mats = [_workload(rng, kind, g, 1000.0) for _ in range(FLAGS.matrices)]
      row = dict(gpus=g, servers=n, workload=kind,
                 paper_us=PAPER_US.get(g))
      timers = {
          "server_level": lambda t, k: cpp.time_schedule(t, n, m, k, False),
          "per_gpu": lambda t, k: cpp.time_schedule(t, n, m, k, True, 0),
          "full": lambda t, k: cpp.time_schedule(t, n, m, k, True,
                                                 ranges=True),
          "full_rows": lambda t, k: cpp.time_schedule(t, n, m, k, True),
          "rank_program": lambda t, k: cpp.time_rank_program(t, n, m, 0, k),
          "rank_program_below_bound": lambda t, k: cpp.time_rank_program(
              t, n, m, 0, k, below_bound=True),
      }
      if g <= FLAGS.whole_plan_max_gpus:
        timers["rank_program_whole_plan"] = (
            lambda t, k: cpp.time_rank_program(t, n, m, 0, k, per_rank=False))
      for mode, timer in timers.items():
        row[mode] = _time(timer, mats)
      each = [_workload(rng, kind, g, 1000.0)
              for _ in range(FLAGS.distinct_matrices)]
      for mode, buffers in (("distinct", "warm"), ("cold", "cold"),
                            ("new", "new")):
        row["full_" + mode] = _each(each, n, m, buffers=buffers, ranges=True)
        row["full_rows_" + mode] = _each(each, n, m, buffers=buffers)
      d = cpp.schedule_arrays(mats[0], n, m, True)
      row["bvn_stages"] = int(d["weights"].shape[0])
      row["transfers"] = int(d["transfers"].shape[0] +
                             d["redistribution"].shape[0])
      results.append(row)
      print(f"runtime G={g} {kind}: server-level "
            f"{row['server_level']['median_us']:.1f} us, per-GPU "
            f"{row['per_gpu']['median_us']:.1f} us, full "
            f"{row['full']['median_us']:.1f} us (distinct matrices "
            f"{row['full_distinct']['median_us']:.1f}, cold "
            f"{row['full_cold']['median_us']:.1f}, new buffers "
            f"{row['full_new']['median_us']:.1f}; rows: distinct "
            f"{row['full_rows_distinct']['median_us']:.1f}, cold "
            f"{row['full_rows_cold']['median_us']:.1f}), rank program "
            f"{row['rank_program']['median_us']:.1f} us (below the "
            f"workspace bound "
            f"{row['rank_program_below_bound']['median_us']:.1f}), paper "
            f"{row['paper_us']}",
            flush=True)
  return results


def write_runtime(results, meta):
  if not results:
    return
  stem = os.path.join(FLAGS.out, "fast_scheduler" + FLAGS.suffix)
  with open(stem + ".json", "w") as f:
    json.dump(dict(meta=meta, results=results), f, indent=1)
  lines = ["# FAST scheduler runtime (C++, moe_jax._fast)", "",
           f"- date: {meta['date']}", f"- command: `{meta['command']}`",
           f"- commit: {meta.get('commit')}",
           f"- device: {meta['device']}",
           f"- Python {meta['python']}, numpy {meta['numpy']}, jax {meta['jax']}",
           f"- {FLAGS.gpus_per_server} GPUs per server, {FLAGS.matrices} fresh "
           "matrices per row (uniform sizes in [0, 2000]; Zipf skew "
           f"{FLAGS.zipf_skew}, global ranks), median of all timed runs; "
           "buffers reused between runs",
           "- `server-level`: server matrix, padding, Birkhoff-von Neumann "
           "stages and real units per stage (with the documented rounding "
           "rule this fixes every GPU's per-stage volume); `per-GPU`: plus "
           "the flow-level transfers GPU 0 sends or receives (what one rank "
           "executes; each rank computes its own)",
           "- `full`: the whole schedule, every GPU's transfers, in the "
           "ranges form (`FastScheduler::ScheduleRanges`, "
           "xla_ffi/fast/scheduler.h: server-level part, every balancing "
           "row, each GPU's units per server and each server pair's units "
           "sent before every stage; every scale-out and redistribution "
           "transfer with its (src, dst) flow follows from these without a "
           "search, `cpp.rows_from_ranges` decodes them and a test checks "
           "the decoded rows against the rows form); `full, rows`: the same "
           "schedule with every transfer written as a row (ranges, then "
           "`ExpandRows`)",
           "- `same`: one matrix timed repeatedly; `distinct`: once on each "
           f"of {FLAGS.distinct_matrices} other matrices, one scheduler "
           "reused (no matrix seen twice); `cold`: the same after 64 MiB of "
           "other writes before each call (cold caches); `new buffers`: a "
           "new scheduler and output per call after those writes (buffers "
           "allocated and first touched inside the timed call); medians",
           "- `rank program`: what the CUDA custom call computes per call on "
           "rank 0 (`StagedPlanner::BuildRank`: traffic check, rank 0's "
           "per-GPU schedule, its program; buffers that just hold the "
           "traffic, default workspace); `fallback below bound`: the same "
           "with one workspace row less than the proven bound, where every "
           "rank also builds the full schedule (ranges form) and checks "
           "every rank's workspace use (what the custom call runs then); "
           "`whole plan`: the same program extracted from the full "
           "schedule's rows and every rank's plan (`cpp.execution_plan`, "
           "used by tests and the simulator, not by the custom call; only "
           f"up to {FLAGS.whole_plan_max_gpus} GPUs)",
           "- paper: FAST (NSDI '26) section 4.4 / Figure 16, Xeon Platinum "
           "8468; its 16-GPU number is from the SyCCL comparison", "",
           "| GPUs | workload | BvN stages | transfers (all GPUs) | "
           "server-level (us) | per-GPU (us) | full, same (us) | "
           "full, distinct (us) | full, distinct p90 (us) | full, cold (us) | "
           "full, new buffers (us) | full rows, distinct (us) | "
           "full rows, cold (us) | rank program (us) | "
           "fallback below bound (us) | whole plan (us) | paper (us) | "
           "paper / full, distinct | paper / full, cold | "
           "paper / full, new buffers | paper / full rows, distinct | "
           "paper / full rows, cold | paper / fallback below bound | "
           "paper / whole plan |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
           "| --- | --- |"]
  for r in results:
    p = r["paper_us"]

    def ratio(x):
      return "—" if p is None else f"{p / x:.1f}x"

    def us(key):
      return r[key]["median_us"]

    whole = r.get("rank_program_whole_plan")
    whole_us = "—" if whole is None else f"{whole['median_us']:.1f}"
    lines.append(
        f"| {r['gpus']} | {r['workload']} | {r['bvn_stages']} | "
        f"{r['transfers']} | {us('server_level'):.1f} | "
        f"{us('per_gpu'):.1f} | {us('full'):.1f} | "
        f"{us('full_distinct'):.1f} | {r['full_distinct']['p90_us']:.1f} | "
        f"{us('full_cold'):.1f} | {us('full_new'):.1f} | "
        f"{us('full_rows_distinct'):.1f} | {us('full_rows_cold'):.1f} | "
        f"{us('rank_program'):.1f} | {us('rank_program_below_bound'):.1f} | "
        f"{whole_us} | {'—' if p is None else p} | "
        f"{ratio(us('full_distinct'))} | {ratio(us('full_cold'))} | "
        f"{ratio(us('full_new'))} | {ratio(us('full_rows_distinct'))} | "
        f"{ratio(us('full_rows_cold'))} | "
        f"{ratio(us('rank_program_below_bound'))} | "
        f"{'—' if whole is None else ratio(whole['median_us'])} |")
  with open(stem + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")


def run_simulation(rng, runtime):
  m = FLAGS.gpus_per_server
  fabric = sim.Fabric(sim.NVLINK_H200, sim.IB_400G)
  sched_us = {(r["gpus"], r["workload"]): r["full_distinct"]["median_us"]
              for r in runtime}
  results = []
  for kind in ("uniform", "zipf", "zipf_row"):
    for g in map(int, FLAGS.sim_gpus):
      n = g // m
      t = _workload(rng, kind, g, FLAGS.mean_bytes)
      d = cpp.schedule_arrays(t, n, m, True)
      rows = np.concatenate([d["transfers"], d["redistribution"]])
      fast = sim.fast_time_from_rows(rows, d["weights"].shape[0], n, m, fabric)
      seq = sim.fast_time_from_rows(rows, d["weights"].shape[0], n, m, fabric,
                                    pipeline_balance=False)
      shared = sim.fast_time_from_rows(rows, d["weights"].shape[0], n, m,
                                       fabric, ports="shared")
      bound = sim.bound_time(t, n, m, fabric)
      r = dict(gpus=g, workload=kind, bvn_stages=int(d["weights"].shape[0]),
               bound_ms=bound * 1e3,
               two_tier_bound_ms=sim.two_tier_bound_time(t, n, m, fabric) * 1e3,
               fast_ms=fast["total"] * 1e3,
               fast_shared_ports_ms=shared["total"] * 1e3,
               fast_parts_ms={k: v * 1e3 for k, v in fast.items()
                              if np.isscalar(v) and not isinstance(v, str)},
               fast_balance_chunks=len(fast["balance_starts"]),
               fast_stages_reordered=fast["stage_order"] != sorted(
                   fast["stage_order"]),
               fast_balance_timing=fast["balance_timing"],
               fast_sequential_ms=seq["total"] * 1e3,
               spreadout_ms=sim.spreadout_time(t, n, m, fabric) * 1e3,
               direct_ms=sim.direct_time(t, n, m, fabric) * 1e3)
      s = sched_us.get((g, "zipf" if kind == "zipf_row" else kind))
      r["scheduler_us_measured"] = s
      r["fast_with_scheduler_ms"] = (None if s is None
                                     else r["fast_ms"] + s / 1e3)
      results.append(r)
      print(f"sim {kind} G={g}: FAST/bound {r['fast_ms'] / r['bound_ms']:.3f} "
            f"(shared ports {r['fast_shared_ports_ms'] / r['bound_ms']:.3f}) "
            f"(sequential {r['fast_sequential_ms'] / r['bound_ms']:.3f}) "
            f"SpreadOut/bound {r['spreadout_ms'] / r['bound_ms']:.3f}",
            flush=True)
  return results, fabric


def write_simulation(results, meta, fabric):
  stem = os.path.join(FLAGS.out, "fast_simulation" + FLAGS.suffix)
  with open(stem + ".json", "w") as f:
    json.dump(dict(meta=meta, results=results), f, indent=1)
  up, so = fabric.scale_up, fabric.scale_out
  lines = ["# FAST simulated all-to-all(v) completion time vs the bound", "",
           f"- date: {meta['date']}", f"- command: `{meta['command']}`",
           f"- commit: {meta.get('commit')}",
           f"- computed on: {meta['device']}",
           f"- Python {meta['python']}, numpy {meta['numpy']}, jax {meta['jax']}",
           f"- fabric: scale-up {up.bandwidth_Bps / 1e9:.0f} GB/s per GPU, "
           f"alpha {up.alpha_s * 1e6:.0f} us (H200 NVLink as in the paper); "
           f"scale-out {so.bandwidth_Bps / 1e9:.0f} GB/s per NIC, alpha "
           f"{so.alpha_s * 1e6:.0f} us (400G InfiniBand); alphas are our "
           "assumption (the paper gives none)",
           f"- {FLAGS.gpus_per_server} GPUs per server, mean "
           f"{FLAGS.mean_bytes / 1e6:.0f} MB per GPU pair; workloads: uniform "
           f"sizes, Zipf {FLAGS.zipf_skew} over all G^2 entries (`zipf`), Zipf "
           f"{FLAGS.zipf_skew} within each sender's row (`zipf_row`)",
           "- bound: heaviest server's inter-server bytes / (M x scale-out "
           "bandwidth), infinitely fast scale-up (the paper's optimum); "
           "`FAST+sched` adds the C++ scheduler median measured here "
           "(full schedule, distinct matrices; `zipf_row` uses the `zipf` "
           "runtime); direct: every flow at once, "
           "fluid sharing, no incast loss (optimistic); every BvN stage "
           "pays the scale-out alpha",
           "- two-tier bound: `simulator.two_tier_bound_time`, the bound "
           "or, if larger, every GPU's bytes sent (received) over its "
           "scale-up + NIC bandwidth and its intra-server bytes over the "
           "scale-up bandwidth, whichever is largest (a lower bound for any "
           "schedule, proof in its docstring); the headline is `FAST / "
           "bound`",
           "- ports: `FAST`, `sequential` and the parts use the duplex port "
           "model (`ports=\"duplex\"`: every GPU's scale-up and NIC ports "
           "have separate send and receive directions, overlapping steps "
           "queue only on the ports they use); `FAST shared` is the same "
           "pipelined schedule with one scale-up timeline (`ports=\"shared\"`, "
           "every scale-up step after the previous one). SpreadOut and "
           "direct are the same in both models (SpreadOut's stages are "
           "permutations, one send and one receive per GPU; direct charges "
           "each GPU's send and receive per tier)",
           "- `FAST`: balancing pipelined with the scale-out stages "
           "(`simulator.fast_time_from_rows`, `pipeline_balance=True`: "
           "balancing cut into chunks by the stage that first carries each "
           "server pair, chunk j done before its first stage, stages in the "
           "built, the light-balancing-first or the ends-light order, "
           "balancing timed by pair (due before the pair's first stage) or "
           "by use (each balanced unit due before the stage that sends it), "
           "the best of these and of the tried chunkings); `sequential`: all "
           "balancing before the first scale-out stage "
           "(`pipeline_balance=False`); `chunks`: balancing chunks used (1 = "
           "sequential), `reordered`: stages not in built order, `timing`: "
           "balancing by `pair` or `use`",
           "- `balance`: the whole balancing as one scale-up step / bound; "
           "`exposed`: the part before the first scale-out stage (FAST); "
           "`redistribute`: summed per-stage redistribution steps / bound "
           "(overlapping the next scale-out stage but the last)",
           "",
           "| workload | GPUs | BvN stages | bound (ms) | FAST / bound | "
           "FAST / two-tier bound | two-tier bound / bound | "
           "FAST shared / bound | "
           "sequential / bound | FAST+sched / bound | SpreadOut / bound | "
           "direct / bound | balance | exposed | redistribute | chunks | "
           "reordered | timing |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in results:
    b = r["bound_ms"]
    ws = r["fast_with_scheduler_ms"]
    lines.append(
        f"| {r['workload']} | {r['gpus']} | {r['bvn_stages']} | {b:.2f} | "
        f"{r['fast_ms'] / b:.3f} | "
        f"{r['fast_ms'] / r['two_tier_bound_ms']:.3f} | "
        f"{r['two_tier_bound_ms'] / b:.3f} | "
        f"{r['fast_shared_ports_ms'] / b:.3f} | "
        f"{r['fast_sequential_ms'] / b:.3f} | "
        f"{'—' if ws is None else f'{ws / b:.3f}'} | "
        f"{r['spreadout_ms'] / b:.3f} | {r['direct_ms'] / b:.3f} | "
        f"{r['fast_parts_ms']['balance'] / b:.3f} | "
        f"{r['fast_parts_ms']['balance_exposed'] / b:.3f} | "
        f"{r['fast_parts_ms']['redistribute'] / b:.3f} | "
        f"{r['fast_balance_chunks']} | "
        f"{'yes' if r['fast_stages_reordered'] else 'no'} | "
        f"{r['fast_balance_timing']} |")
  with open(stem + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  kinds = sorted({r["workload"] for r in results},
                 key=["uniform", "zipf", "zipf_row"].index)
  fig, axes = plt.subplots(1, len(kinds), figsize=(4.5 * len(kinds), 3.6),
                           squeeze=False)
  for ax, kind in zip(axes[0], kinds):
    rows = [r for r in results if r["workload"] == kind]
    gs = [r["gpus"] for r in rows]
    for key, label in (("fast_ms", "FAST (pipelined balancing)"),
                       ("fast_shared_ports_ms",
                        "FAST (pipelined, shared scale-up timeline)"),
                       ("fast_sequential_ms", "FAST (sequential balancing)"),
                       ("fast_with_scheduler_ms", "FAST + scheduler"),
                       ("spreadout_ms", "SpreadOut"),
                       ("direct_ms", "direct (no incast loss)")):
      ys = [None if r[key] is None else r[key] / r["bound_ms"] for r in rows]
      if any(y is not None for y in ys):
        ax.plot(gs, [np.nan if y is None else y for y in ys], marker="o",
                label=label)
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="bound")
    ax.plot(gs, [r["two_tier_bound_ms"] / r["bound_ms"] for r in rows],
            color="k", lw=0.8, ls=":", label="two-tier bound")
    ax.set_yscale("log")
    ax.set_title(kind)
    ax.set_xlabel("GPUs (8 per server)")
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("completion time / bound")
  axes[0][0].legend(fontsize=7)
  fig.suptitle("FAST simulation: H200 NVLink 450 GB/s + 400G IB, "
               f"{FLAGS.mean_bytes / 1e6:.0f} MB/pair mean")
  fig.tight_layout()
  fig.savefig(stem + ".png", dpi=110)


# NIC : NVLink bandwidth ratios of the executed-plan table: the paper's
# H200 testbed and simulation (400G InfiniBand 50 GB/s vs NVLink 450 GB/s)
# and its AMD testbed (100G RoCE 12.5 GB/s vs Infinity Fabric 448 GB/s).
EXECUTED_FABRICS = {
    "1:9": sim.Fabric(sim.Link(2e-6, 450e9), sim.Link(5e-6, 50e9)),
    "1:35": sim.Fabric(sim.Link(2e-6, 448e9), sim.Link(5e-6, 12.5e9)),
}
EXECUTED_WORKLOADS = {"uniform": None, "zipf0.9": 0.9, "zipf1.2": 1.2}


def _stats(xs):
  xs = [x for x in xs if x is not None]
  if not xs:
    return None
  return dict(min=float(np.min(xs)), median=float(np.median(xs)),
              max=float(np.max(xs)))


# Targets of the executed plan (completion / two-tier bound, every seed).
EXECUTED_TARGETS = {"uniform": 1.05, "zipf0.9": 1.08}
# Phases of a worst seed listed in the record: those with NVLink exposed
# longer than this fraction of the two-tier bound.
WORST_PHASE_MIN = 0.005


def _worst_phases(seed, ex, bound2, fabric):
  """One seed's executed time and the phases whose NVLink part its
  scale-out does not hide: per phase (over the two-tier bound) the
  scale-out, the NVLink part, the busiest NVLink port and its bytes by
  kind as time on that port."""
  up = fabric.scale_up.bandwidth_Bps
  rows = []
  for p in np.flatnonzero(ex["exposed"] > WORST_PHASE_MIN * bound2):
    rows.append(dict(
        phase=int(p), scale_out=float(ex["scale_out"][p] / bound2),
        scale_up=float(ex["scale_up"][p] / bound2),
        port=f"GPU {int(ex['gpu'][p])} " + ("recv" if ex["recv"][p] else "send"),
        **{k: float(ex["bytes"][p, i] / up / bound2)
           for i, k in enumerate(sim.NVLINK_KINDS)}))
  return dict(seed=int(seed), executed=float(ex["total"] / bound2),
              num_phases=int(len(ex["phases"])), phases=rows)


def run_executed():
  """The plan that executes (``cpp.execution_plan``, what the custom call
  issues) timed by ``simulator.executed_plan_time``, over the two-tier
  bound, per seed; next to the simulator's layout search."""
  results = []
  for shape in FLAGS.executed_shapes:
    n, m = map(int, shape.split("x"))
    g = n * m
    for kind, skew in EXECUTED_WORKLOADS.items():
      per = {r: dict(executed=[], searched=[], bound_ratio=[], phases=[],
                     exposed_first=[], exposed_middle=[], exposed_last=[],
                     **{f"exposed_{k}": [] for k in sim.NVLINK_KINDS},
                     above=[])
             for r in EXECUTED_FABRICS}
      t0 = time.perf_counter()
      for seed in range(FLAGS.executed_seeds):
        rng = np.random.default_rng([FLAGS.seed, g, seed])
        t = (workloads.uniform_matrix(rng, g, FLAGS.mean_bytes)
             if skew is None else
             workloads.zipf_matrix(rng, g, skew, FLAGS.mean_bytes))
        plan = cpp.execution_plan(t, n, m)
        rows = None
        if n <= FLAGS.search_max_servers:
          d = cpp.schedule_arrays(t, n, m, True)
          rows = np.concatenate([d["transfers"], d["redistribution"]])
        for ratio, fabric in EXECUTED_FABRICS.items():
          bound2 = sim.two_tier_bound_time(t, n, m, fabric)
          ex = sim.executed_phase_breakdown(plan, fabric)
          per[ratio]["executed"].append(ex["total"] / bound2)
          # Exposed NVLink time by what the busiest port carried (shares
          # of its bytes in each phase).
          load = ex["bytes"].sum(axis=1, keepdims=True)
          share = np.divide(ex["bytes"], load, out=np.zeros_like(ex["bytes"]),
                            where=load > 0)
          by_kind = (share * ex["exposed"][:, None]).sum(axis=0) / bound2
          for k, v in zip(sim.NVLINK_KINDS, by_kind):
            per[ratio][f"exposed_{k}"].append(float(v))
          if ex["total"] / bound2 > EXECUTED_TARGETS.get(kind, np.inf):
            per[ratio]["above"].append(
                _worst_phases(seed, ex, bound2, fabric))
          # NVLink time no scale-out of its phase hides: phases 0-1 (first
          # balancing, the second stage's balancing behind the first
          # scale-out), the middle phases, the last redistribution.
          hidden = np.maximum(ex["scale_up"] - ex["scale_out"], 0) / bound2
          per[ratio]["exposed_first"].append(float(hidden[:2].sum()))
          per[ratio]["exposed_middle"].append(float(hidden[2:-1].sum()))
          per[ratio]["exposed_last"].append(float(hidden[-1]))
          per[ratio]["phases"].append(int(plan.num_phases))
          per[ratio]["bound_ratio"].append(
              bound2 / sim.bound_time(t, n, m, fabric))
          per[ratio]["searched"].append(
              None if rows is None else sim.fast_time_from_rows(
                  rows, d["weights"].shape[0], n, m, fabric)["total"] / bound2)
      for ratio, v in per.items():
        r = dict(shape=shape, servers=n, gpus_per_server=m, workload=kind,
                 ratio=ratio, seeds=FLAGS.executed_seeds,
                 executed_over_two_tier=_stats(v["executed"]),
                 searched_over_two_tier=_stats(v["searched"]),
                 two_tier_over_bound=_stats(v["bound_ratio"]),
                 phases=_stats(v["phases"]),
                 exposed_up=dict(first=_stats(v["exposed_first"]),
                                 middle=_stats(v["exposed_middle"]),
                                 last=_stats(v["exposed_last"]),
                                 **{k: _stats(v[f"exposed_{k}"])
                                    for k in sim.NVLINK_KINDS}),
                 seeds_above_target=v.pop("above"), raw=v)
        results.append(r)
        e = r["executed_over_two_tier"]
        print(f"executed {shape} {kind} {ratio}: {e['min']:.3f} / "
              f"{e['median']:.3f} / {e['max']:.3f} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
  return results


def write_executed(results, meta):
  stem = os.path.join(FLAGS.out, "fast_executed" + FLAGS.suffix)
  with open(stem + ".json", "w") as f:
    json.dump(dict(meta=meta, results=results), f, indent=1)
  fab = "; ".join(
      f"{k}: NIC {v.scale_out.bandwidth_Bps / 1e9:g} GB/s (alpha "
      f"{v.scale_out.alpha_s * 1e6:g} us) vs NVLink "
      f"{v.scale_up.bandwidth_Bps / 1e9:g} GB/s (alpha "
      f"{v.scale_up.alpha_s * 1e6:g} us)" for k, v in EXECUTED_FABRICS.items())
  lines = ["# FAST: the executed plan's simulated completion time vs the "
           "two-tier bound", "",
           f"- date: {meta['date']}", f"- command: `{meta['command']}`",
           f"- commit: {meta.get('commit')}",
           f"- computed on: {meta['device']}",
           f"- Python {meta['python']}, numpy {meta['numpy']}, jax {meta['jax']}",
           f"- fabrics (NIC : NVLink per GPU): {fab}",
           f"- mean {FLAGS.mean_bytes / 1e6:.0f} MB per GPU pair; uniform "
           "sizes in [0, 2 x mean], Zipf 0.9 / 1.2 over all G^2 entries; "
           f"{FLAGS.executed_seeds} seeds per row (`np.random.default_rng("
           "[seed, G, i]`)",
           "- `executed`: `simulator.executed_plan_time` of "
           "`cpp.execution_plan` (the ops the staged all-to-all issues: its "
           "phases in sequence, one NCCL group each, every op of a phase at "
           "once on its link, NVLink ops on the GPUs' scale-up send/receive "
           "ports, inter-server ops on their NICs, full duplex; a phase "
           "lasts max over tiers of alpha + busiest port / bandwidth) over "
           "`simulator.two_tier_bound_time`; min / median / max over the "
           "seeds",
           "- `searched layout` (comparison only, not what executes): "
           "`simulator.fast_time_from_rows` of the same schedule, the best "
           "of its pipelined layouts (balancing chunks, stage orders) on "
           "duplex ports; only up to "
           f"{FLAGS.search_max_servers} servers",
           "- `two-tier / bound`: the two-tier bound over the paper's bound "
           "(heaviest server's inter-server bytes / (M x NIC bandwidth))",
           "- `exposed NVLink`: per phase, how much longer its NVLink part "
           "lasts than its scale-out (`executed_plan_time`'s `scale_up` - "
           "`scale_out`, when positive), over the two-tier bound, summed over "
           "phases 0-1 (the first stage's balancing, the second's behind the "
           "first scale-out), the middle phases and the last (the last "
           "redistribution); medians over the seeds",
           "- `exposed by kind`: the same exposed time per phase split in "
           "proportion to what the busiest NVLink port carried in it "
           "(`simulator.executed_phase_breakdown`: balancing / "
           "redistribution / intra-server flows), summed over the phases; "
           "medians over the seeds", "",
           "| servers x GPUs | traffic | NIC:NVLink | executed / two-tier "
           "bound (min / median / max) | searched layout / two-tier bound "
           "(comparison) | two-tier / bound (median) | phases (median) | "
           "exposed NVLink: phases 0-1 / middle / last | exposed by kind: "
           "balancing / redistribution / intra |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

  def fmt(x):
    return ("—" if x is None else
            f"{x['min']:.3f} / {x['median']:.3f} / {x['max']:.3f}")

  for r in results:
    lines.append(
        f"| {r['shape']} | {r['workload']} | {r['ratio']} | "
        f"{fmt(r['executed_over_two_tier'])} | "
        f"{fmt(r['searched_over_two_tier'])} | "
        f"{r['two_tier_over_bound']['median']:.3f} | "
        f"{r['phases']['median']:.0f} | "
        f"{r['exposed_up']['first']['median']:.3f} / "
        f"{r['exposed_up']['middle']['median']:.3f} / "
        f"{r['exposed_up']['last']['median']:.3f} | " +
        " / ".join(f"{r['exposed_up'][k]['median']:.3f}"
                   for k in sim.NVLINK_KINDS) + " |")
  missed = [r for r in results if r["seeds_above_target"]]
  lines += ["", "## Seeds above the target", "",
            "Every seed above its row's target (uniform "
            f"{EXECUTED_TARGETS['uniform']}, Zipf 0.9 "
            f"{EXECUTED_TARGETS['zipf0.9']}): its phases with NVLink "
            f"exposed by more than {WORST_PHASE_MIN} x the two-tier bound; "
            "per phase, over the two-tier bound, the scale-out, the NVLink "
            "part, and the busiest NVLink port's bytes by kind as time on "
            "that port (`simulator.executed_phase_breakdown`).", ""]
  if not missed:
    lines.append("None.")
  for r, w in ((r, w) for r in missed for w in r["seeds_above_target"]):
    lines += [f"### {r['shape']} {r['workload']} {r['ratio']}: seed {w['seed']}"
              f", {w['executed']:.3f}, {w['num_phases']} phases", "",
              "| phase | scale-out | NVLink | busiest port | balancing | "
              "redistribution | intra |", "| --- | --- | --- | --- | --- | "
              "--- | --- |"]
    for ph in w["phases"]:
      lines.append(
          f"| {ph['phase']} | {ph['scale_out']:.3f} | {ph['scale_up']:.3f} | "
          f"{ph['port']} | " + " | ".join(f"{ph[k]:.3f}"
                                           for k in sim.NVLINK_KINDS) + " |")
    lines.append("")
  with open(stem + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")


def main(argv):
  del argv
  if not FLAGS.out:
    raise app.UsageError("--out is required (the folder for the results)")
  if not cpp.available():
    raise SystemExit("moe_jax._fast is not built")
  os.makedirs(FLAGS.out, exist_ok=True)
  rng = np.random.default_rng(FLAGS.seed)
  runtime = run_runtime(rng)
  meta = _meta(code_meta())
  write_runtime(runtime, meta)
  if runtime:
    print("wrote", os.path.join(FLAGS.out, f"fast_scheduler{FLAGS.suffix}.md"))
  if FLAGS.executed_shapes:
    write_executed(run_executed(), meta)
    print("wrote", os.path.join(FLAGS.out, f"fast_executed{FLAGS.suffix}.md"))
  if not FLAGS.sim_gpus:
    return
  results, fabric = run_simulation(rng, runtime)
  write_simulation(results, meta, fabric)
  print("wrote", os.path.join(FLAGS.out, f"fast_simulation{FLAGS.suffix}.md"))


if __name__ == "__main__":
  cli.run(main)

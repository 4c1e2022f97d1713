"""Asynchronous vs. synchronous expert parallelism: a decode-serving simulation.

CPU devices (tiny model, the table in docs/benchmarks/async_ep/async_ep_cpu.md):

    python benchmarks/async_ep_bench.py

Four GPUs of one host (writes async_ep_4xH200.{json,md,png} into --out
on H200s; estimated 4-5 minutes, compilation and cost measurement included):

    python benchmarks/async_ep_bench.py --platform=gpu --num_devices=4 --hidden=2048 --ffn=8192 --heads=16 --num_blocks=4 --max_batch=128 --total_slots=128 --num_requests=192 --length_scale=0.3

A Mixtral-style decoder (moe_jax.async_ep.model, random weights, float32,
8 experts top-2, expert e receiving a share of the picks proportional to
exp(-skew * e / E), the router bias calibrated to it) is served
on D devices of --platform. The synchronous baseline is barrier-synchronous
EP with DP attention on every device (one rank per device, expert e on
device e % D, all active requests advance one position per step, a barrier
after every attention, expert and sampler phase). The asynchronous engine
runs with each scheduler on each layout of --async_layouts: "colocated"
(the same placement as the baseline) and "disaggregated" (AMoE's layout:
attention ranks on the first --attention_devices devices, experts on the
rest). Every engine gets the same total number of KV slots (--total_slots,
split evenly over its ranks).

What is measured and what is simulated:
  * every layer execution really runs on the devices (that produces the
    tokens, the routing and hence every batch size);
  * its cost is taken from a table measured on the same devices before the
    runs (--cost=table: seconds per execution for each layer kind and padded
    batch size, median of back-to-back executions with inputs already on
    the device), so that all engines and rates are compared on the same,
    deterministic costs; --cost=measured uses each call's host wall time
    instead, --cost=model a + b * padded rows;
  * time is simulated: every async device has its own clock and the
    devices overlap; a message to another device arrives --latency_us after
    the execution that produced it (at once on the same device); the
    synchronous baseline's phase lasts as long as its busiest device plus
    --latency_us for the exchange at the barrier.

Requests arrive by a Poisson process; input/output lengths are drawn
uniformly from the AMoE paper's ranges (short: input [30, 70], output
[70, 130]; medium: input [50, 150], output [50, 250]) times --length_scale;
prefill runs token by token (teacher forcing) in both systems. --rates=auto
offers --auto_fractions (0.5, 1 and 2) times the baseline's estimated capacity.
Reports generated tokens/s, inter-token latency and device utilization
against offered load.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks.provenance import (commit, extension_digest, portable_command,  # noqa: E402
                                   source_digest)
from moe_jax import cli  # noqa: E402
from moe_jax.async_ep import tokens as tk  # noqa: E402
from moe_jax.async_ep.baseline import SyncEngine  # noqa: E402
from moe_jax.async_ep.costs import CostTable  # noqa: E402
from moe_jax.async_ep.dispatcher import Placement  # noqa: E402
from moe_jax.async_ep.executor import TimedAsyncEngine  # noqa: E402
from moe_jax.async_ep.model import (LayerKernels, TinyMoEConfig, bucket_for, init_params,  # noqa: E402
                                    normalized_gaussian_rows, realized_expert_shares,
                                    target_expert_shares)
from moe_jax.async_ep.requests import Request  # noqa: E402
from moe_jax.async_ep.schedulers import make_scheduler  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("platform", "cpu", ["cpu", "gpu"], "JAX platform of the devices.")
flags.DEFINE_enum("workload", "short", ["short", "medium"], "Length ranges (AMoE paper).")
flags.DEFINE_float("length_scale", 0.2, "Multiplier on the paper's input/output lengths.")
flags.DEFINE_list("rates", ["auto"], "Offered loads, requests/s (simulated), or 'auto'.")
flags.DEFINE_list("auto_fractions", ["0.5", "1", "2"],
                  "--rates=auto: offered loads as fractions of the baseline's capacity.")
flags.DEFINE_integer("num_requests", 256, "Requests per run.")
flags.DEFINE_list("schedulers", ["defrag", "mtfs", "flfs"], "Async schedulers.")
flags.DEFINE_list("async_layouts", ["colocated", "disaggregated"], "Async placements.")
flags.DEFINE_integer("attention_devices", 2, "Disaggregated layout: attention devices.")
flags.DEFINE_integer("lookahead", 7, "Defrag lookahead K.")
flags.DEFINE_float("decay", 0.8, "Defrag decay delta.")
flags.DEFINE_integer("num_devices", 4, "Devices.")
flags.DEFINE_integer("total_slots", 128, "Concurrent requests (KV slots) over all ranks.")
flags.DEFINE_integer("num_blocks", 4, "Decoder blocks.")
flags.DEFINE_integer("num_experts", 8, "Experts per block.")
flags.DEFINE_integer("top_k", 2, "Experts per token.")
flags.DEFINE_integer("hidden", 64, "Hidden size.")
flags.DEFINE_integer("ffn", 256, "Expert FFN size.")
flags.DEFINE_integer("heads", 4, "Attention heads.")
flags.DEFINE_integer("max_batch", 64, "Largest bucket (power of two).")
flags.DEFINE_enum("matmul", "xla", ["xla", "row_invariant"],
                  "The model's arithmetic (TinyMoEConfig.matmul): row_invariant makes every "
                  "row's bits independent of the batch size, so every engine generates the "
                  "same tokens on GPUs too, at the cost of slower kernels.")
flags.DEFINE_float("expert_skew", 3.0, "Expert e's share of the picks is proportional to "
                   "exp(-skew * e / E) (0: uniform); the router bias is calibrated to it.")
flags.DEFINE_float("latency_us", 20.0, "Message latency (async) / per-barrier latency (sync).")
flags.DEFINE_enum("cost", "table", ["table", "measured", "model"], "Execution cost.")
flags.DEFINE_float("model_fixed_us", 100.0, "--cost=model: fixed cost per execution.")
flags.DEFINE_float("model_row_us", 2.0, "--cost=model: cost per padded row.")
flags.DEFINE_integer("cost_rounds", 15, "--cost=table: rounds per (kind, bucket, device).")
flags.DEFINE_integer("max_executions", 2_000_000, "Async: stop after this many executions.")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("out", None, "Output folder. Required: the records under docs/benchmarks/ are only written when named.")
flags.DEFINE_string("suffix", "", "Appended to the output stem.")

RANGES = {"short": ((30, 70), (70, 130)), "medium": ((50, 150), (50, 250))}


def scaled_ranges():
    s = FLAGS.length_scale
    return [(max(1, round(lo * s)), max(1, round(hi * s))) for lo, hi in RANGES[FLAGS.workload]]


def make_workload(rate, rng, vocab):
    (ilo, ihi), (olo, ohi) = scaled_ranges()
    t, out = 0.0, []
    for i in range(FLAGS.num_requests):
        t += rng.exponential(1.0 / rate)
        n_in = int(rng.integers(ilo, ihi + 1))
        n_out = int(rng.integers(olo, ohi + 1))
        out.append(Request(i, [int(x) for x in rng.integers(0, vocab, n_in)], n_out, arrival=t))
    return out


def sync_capacity(cost, latency, num_ranks):
    """Requests/s the baseline sustains with every slot busy (cost estimate)."""
    c_slots = FLAGS.total_slots // num_ranks
    rows = min(c_slots, FLAGS.max_batch)
    chunks = math.ceil(c_slots / FLAGS.max_batch)
    per_expert = max(1, min(FLAGS.max_batch, FLAGS.total_slots * FLAGS.top_k
                            // FLAGS.num_experts))
    experts_per_device = math.ceil(FLAGS.num_experts / FLAGS.num_devices)
    attn = chunks * cost(tk.attention_layer(0, 0), rows)
    expert = experts_per_device * cost(tk.expert_layer(0, 0), per_expert)
    sampler = chunks * cost(tk.sampler_layer(1, 0), rows)
    step = FLAGS.num_blocks * (attn + expert + 2 * latency) + sampler + latency
    (ilo, ihi), (olo, ohi) = scaled_ranges()
    positions = (ilo + ihi) / 2 + (olo + ohi) / 2 - 1
    return FLAGS.total_slots / step / positions


def metrics(result, requests):
    gens = sum(len(v) for v in result.outputs.values())
    ends = [max(v) for v in result.token_times.values() if v]
    start = min(r.arrival for r in requests)
    span = (max(ends) - start) if ends else float("nan")
    itl = np.concatenate([np.diff(v) for v in result.token_times.values() if len(v) > 1] or
                         [np.zeros(0)])
    done = sum(len(result.outputs.get(r.request_id, [])) == r.max_new_tokens for r in requests)
    busy = np.asarray(result.device_busy_s or [np.nan]) / span
    return dict(tokens=gens, sim_span_s=span, throughput_tok_s=gens / span if ends else 0.0,
                itl_mean_ms=float(np.mean(itl) * 1e3) if itl.size else float("nan"),
                itl_p50_ms=float(np.percentile(itl, 50) * 1e3) if itl.size else float("nan"),
                itl_p99_ms=float(np.percentile(itl, 99) * 1e3) if itl.size else float("nan"),
                completed=done, requests=len(requests), mean_batch=result.mean_batch,
                executions=result.executions, host_wall_s=result.wall_s,
                util_mean=float(np.mean(busy)), util_max=float(np.max(busy)),
                util_per_device=[round(float(u), 3) for u in busy])


def device_name(devices):
    if FLAGS.platform == "cpu":
        return "cpu"
    kind = devices[0].device_kind.split()[-1]
    return f"{len(devices)}x{kind}"


def main(argv):
    del argv
    if not FLAGS.out:
        raise app.UsageError("--out is required (the folder for the results)")
    devices = jax.devices(FLAGS.platform)[:FLAGS.num_devices]
    (_, ihi), (_, ohi) = scaled_ranges()
    config = TinyMoEConfig(vocab=256, hidden=FLAGS.hidden, ffn=FLAGS.ffn, heads=FLAGS.heads,
                           num_blocks=FLAGS.num_blocks, num_experts=FLAGS.num_experts,
                           top_k=FLAGS.top_k, max_len=ihi + ohi + 2,
                           expert_skew=FLAGS.expert_skew, matmul=FLAGS.matmul)
    t0 = time.perf_counter()
    kernels = LayerKernels(config, init_params(jax.random.PRNGKey(FLAGS.seed), config),
                           FLAGS.max_batch)
    latency = FLAGS.latency_us * 1e-6
    d, e, nb = FLAGS.num_devices, FLAGS.num_experts, FLAGS.num_blocks
    layouts = {"colocated": (Placement.colocated(d, d, e, nb), d)}
    if "disaggregated" in FLAGS.async_layouts:
        layouts["disaggregated"] = (Placement.disaggregated(d, FLAGS.attention_devices, e, nb),
                                    FLAGS.attention_devices)

    def engine_args(layout):
        placement, ranks = layouts[layout]
        return dict(num_devices=d, num_ranks=ranks, slots_per_rank=FLAGS.total_slots // ranks,
                    placement=placement, platform=FLAGS.platform)

    used = sorted({"colocated", *FLAGS.async_layouts})
    max_slots = max(engine_args(lay)["slots_per_rank"] for lay in used)
    rank_devs = sorted({r for lay in used for r in layouts[lay][0].rank_devices})
    expert_devs = sorted({x for lay in used for x in layouts[lay][0].expert_devices})
    compiles = 0
    for lay in used:   # the KV cache shape depends on the layout's slots per rank
        placement, _ = layouts[lay]
        compiles += kernels.warm_up([devices[i] for i in sorted(set(placement.rank_devices))],
                                    [devices[i] for i in sorted(set(placement.expert_devices))],
                                    engine_args(lay)["slots_per_rank"])
    print(f"init + warm-up: {compiles} compilations, {time.perf_counter() - t0:.1f} s",
          flush=True)

    t1 = time.perf_counter()
    if FLAGS.cost == "table":
        cost = CostTable.measure(kernels, [devices[i] for i in rank_devs],
                                 [devices[i] for i in expert_devs], max_slots,
                                 rounds=FLAGS.cost_rounds)
    elif FLAGS.cost == "model":
        cost = CostTable.model(FLAGS.model_fixed_us * 1e-6, FLAGS.model_row_us * 1e-6,
                               FLAGS.max_batch)
    else:
        cost = None
    cost_table = cost.as_dict() if cost is not None else None
    if cost_table:
        print(f"cost table ({time.perf_counter() - t1:.1f} s), us per execution:")
        for kind, table in cost_table.items():
            print(f"  {kind:9s} " + " ".join(f"{b}:{s * 1e6:.1f}" for b, s in table.items()))
    estimate = cost if cost is not None else CostTable.model(
        FLAGS.model_fixed_us * 1e-6, FLAGS.model_row_us * 1e-6, FLAGS.max_batch)
    capacity = sync_capacity(estimate, latency, d)
    if FLAGS.rates == ["auto"]:
        rates = [round(capacity * float(f), 1) for f in FLAGS.auto_fractions]
    else:
        rates = [float(r) for r in FLAGS.rates]
    print(f"estimated sync capacity {capacity:.1f} req/s; rates {rates}", flush=True)

    def engines():
        yield "sync", lambda reqs: SyncEngine(kernels, **engine_args("colocated")).run(
            reqs, timed=True, latency_s=latency, cost=cost)
        for layout in FLAGS.async_layouts:
            for name in FLAGS.schedulers:
                kw = dict(lookahead=FLAGS.lookahead, decay=FLAGS.decay) if name == "defrag" else {}
                sched = make_scheduler(name, **kw)
                tag = "" if layout == "colocated" else "-disagg"
                yield f"async-{name}{tag}", lambda reqs, s=sched, lay=layout: TimedAsyncEngine(
                    kernels, s, **engine_args(lay)).run_timed(
                        reqs, latency_s=latency, cost=cost, max_executions=FLAGS.max_executions)

    rows = []
    compiles_warm = kernels.compile_count
    for rate in rates:
        requests = make_workload(rate, np.random.default_rng(FLAGS.seed), config.vocab)
        reference = None
        for name, run in engines():
            result = run(requests)
            m = metrics(result, requests)
            if reference is None:
                reference = result.outputs
            m.update(engine=name, rate_req_s=rate, same_tokens_as_sync=bool(
                all(result.outputs.get(k) == v for k, v in reference.items()
                    if len(result.outputs.get(k, [])) == len(v))))
            rows.append(m)
            print(f"rate {rate:8.1f} {name:20s} {m['throughput_tok_s']:9.1f} tok/s  "
                  f"ITL mean {m['itl_mean_ms']:7.3f} p99 {m['itl_p99_ms']:7.3f} ms  "
                  f"done {m['completed']}/{m['requests']}  batch {m['mean_batch']:5.1f}  "
                  f"util {m['util_mean']:.2f}/{m['util_max']:.2f}  "
                  f"host {m['host_wall_s']:.1f}s", flush=True)
    # Expert load skew: the router's top-k picks on random normalized inputs.
    p0 = kernels.params["blocks"][0]
    xn = normalized_gaussian_rows(4096, config.hidden, seed=1, dtype=np.float32)
    logits = xn @ p0["router"] + p0["router_bias"]
    share = realized_expert_shares(logits, config.top_k)
    target = target_expert_shares(config.num_experts, config.top_k, config.expert_skew)
    assert kernels.compile_count == compiles_warm, "recompiled after warm-up"

    host = (f"{os.cpu_count()} host cores" if FLAGS.platform == "cpu" else
            f"{devices[0].device_kind}")
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="python " + " ".join(sys.argv),
        devices=f"{len(devices)} {FLAGS.platform.upper()} devices (jax.devices("
                f"'{FLAGS.platform}')) on {host}",
        versions=dict(python=platform.python_version(), jax=jax.__version__,
                      numpy=np.__version__, platform=platform.platform(),
                      sources=source_digest(), commit=commit(),
                      extensions=extension_digest()),
        flags={f: FLAGS[f].value for f in [
            "platform", "workload", "length_scale", "rates", "auto_fractions", "num_requests", "schedulers",
            "async_layouts", "attention_devices", "lookahead", "decay", "num_devices",
            "total_slots", "num_blocks", "num_experts", "top_k", "hidden", "ffn", "heads",
            "max_batch", "matmul", "expert_skew", "latency_us", "cost", "seed"]},
        rates=rates, sync_capacity_estimate_req_s=capacity, compilations=compiles_warm,
        cost_table_s=cost_table, model_us=[FLAGS.model_fixed_us, FLAGS.model_row_us],
        expert_share_target=[round(float(s), 4) for s in target],
        expert_share_block0=[round(float(s), 4) for s in share],
        layouts={k: dict(rank_devices=v[0].rank_devices, expert_devices=v[0].expert_devices)
                 for k, v in layouts.items()},
        wall_s=time.perf_counter() - t0)
    os.makedirs(FLAGS.out, exist_ok=True)
    stem = os.path.join(FLAGS.out, "async_ep_" + device_name(devices) + FLAGS.suffix)
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=1)
    write_md(stem + ".md", meta, rows)
    plot(stem + ".png", rows, meta)
    print(f"wrote {stem}.{{json,md}} (and .png with matplotlib) after {meta['wall_s']:.0f} s")


def peak_summary(rows):
    """Per engine: peak tokens/s, its ITL, and the ratio to the sync peak."""
    peaks = {}
    for r in rows:
        best = peaks.get(r["engine"])
        if best is None or r["throughput_tok_s"] > best["throughput_tok_s"]:
            peaks[r["engine"]] = r
    sync = peaks.get("sync")
    lines = ["| engine | peak tokens/s | at offered req/s | ITL mean ms there | vs sync peak |",
             "|---|---:|---:|---:|---:|"]
    for name, r in peaks.items():
        ratio = r["throughput_tok_s"] / sync["throughput_tok_s"] if sync else float("nan")
        lines.append(f"| {name} | {r['throughput_tok_s']:.0f} | {r['rate_req_s']:.0f} | "
                     f"{r['itl_mean_ms']:.3f} | {ratio:.2f}x |")
    return lines, peaks


def write_md(path, meta, rows):
    fl = meta["flags"]
    if fl["cost"] == "table":
        what = (f"the table measured on these {fl['platform'].upper()} devices before the runs "
                "(median time of back-to-back executions, inputs already on the device; "
                "below)")
    elif fl["cost"] == "model":
        what = (f"the model a + b * padded rows (a = {meta['model_us'][0]} us, "
                f"b = {meta['model_us'][1]} us)")
    else:
        what = "the host wall time of that execution (transfers and dispatch included)"
    summary, peaks = peak_summary(rows)
    sync = peaks.get("sync")
    lines = [f"# Asynchronous vs. synchronous expert parallelism ({meta['devices']})", "",
             f"- date: {meta['date']}", f"- command: `{portable_command(meta['command'])}`",
             f"- devices: {meta['devices']}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"- flags: `{json.dumps(fl)}`",
             f"- placements: `{json.dumps(meta['layouts'])}`",
             f"- XLA compilations (all at warm-up, none afterwards): {meta['compilations']}",
             f"- expert load, share of the picks per expert: target {meta['expert_share_target']}, "
             f"router of block 0 on random inputs {meta['expert_share_block0']}",
             f"- offered loads: {meta['rates']} req/s (baseline capacity estimate "
             f"{meta['sync_capacity_estimate_req_s']:.1f} req/s)",
             f"- total wall time: {meta['wall_s']:.0f} s", "",
             "**Measured:** every layer execution runs on the devices (it produces the tokens, "
             "the routing and so every batch size) and costs " + what + ". "
             "**Simulated:** time. Every async device has its own clock and devices overlap; a "
             f"message to another device arrives {fl['latency_us']} us after the execution that "
             "produced it, at once on the same device. The synchronous baseline (DP attention "
             "on every device, expert e on device e % D) waits after every attention, expert "
             "and sampler phase for its busiest device, plus the same latency for the "
             "exchange. All engines hold the same total number of KV slots "
             f"({fl['total_slots']}). `-disagg`: AMoE's layout, attention on devices "
             f"0..{fl['attention_devices'] - 1} and experts on the others.", "",
             "## Peak throughput", ""] + summary
    if sync:
        bound = 1.0 / sync["util_max"]
        lines += ["", f"At its peak the baseline's busiest device is busy "
                  f"{sync['util_max']:.0%} of the time (mean over devices "
                  f"{sync['util_mean']:.0%}). An asynchronous engine that ran exactly the "
                  "baseline's batches with no idle time at all would therefore be at most "
                  f"{bound:.2f}x faster; going beyond needs larger (better amortized) batches "
                  "than one synchronous wave, which in a closed system with the same KV slots "
                  "only a cheaper per-row cost regime can give."]
    if meta["cost_table_s"]:
        buckets = list(next(iter(meta["cost_table_s"].values())))
        lines += ["", "## Cost per execution (us) by padded batch size", "",
                  "| kind | " + " | ".join(str(b) for b in buckets) + " |",
                  "|---|" + "---:|" * len(buckets)]
        for kind, table in meta["cost_table_s"].items():
            lines.append(f"| {kind} | " + " | ".join(f"{table[b] * 1e6:.1f}" for b in buckets)
                         + " |")
    lines += ["", "## All runs", "",
              "| offered req/s | engine | tokens/s | ITL mean ms | ITL p50 ms | ITL p99 ms | "
              "completed | mean batch | executions | util mean / max | same tokens as sync |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['rate_req_s']:.0f} | {r['engine']} | {r['throughput_tok_s']:.0f} | "
                     f"{r['itl_mean_ms']:.3f} | {r['itl_p50_ms']:.3f} | {r['itl_p99_ms']:.3f} | "
                     f"{r['completed']}/{r['requests']} | {r['mean_batch']:.1f} | "
                     f"{r['executions']} | {r['util_mean']:.2f} / {r['util_max']:.2f} | "
                     f"{r['same_tokens_as_sync']} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(path, rows, meta):
    """The throughput and latency curves as a PNG (skipped without matplotlib,
    the [bench] extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot written")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for engine in dict.fromkeys(r["engine"] for r in rows):
        rs = [r for r in rows if r["engine"] == engine]
        axes[0].plot([r["rate_req_s"] for r in rs], [r["throughput_tok_s"] for r in rs],
                     "o-", label=engine)
        axes[1].plot([r["throughput_tok_s"] for r in rs], [r["itl_mean_ms"] for r in rs],
                     "o-", label=engine)
    axes[0].set(xlabel="offered load (requests/s, simulated)", ylabel="throughput (tokens/s)",
                title="Throughput vs offered load")
    axes[1].set(xlabel="throughput (tokens/s)", ylabel="mean inter-token latency (ms)",
                title="ITL vs throughput")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Async vs sync expert parallelism, {meta['devices']} (simulated time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    cli.run(main)

"""Markdown table and latency-CDF plot from a dispatch_bench JSON file.

    python -m benchmarks.report docs/benchmarks/dispatch/dispatch_4xH100_loop.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from benchmarks.provenance import portable_command


def _fmt(v, digits=1):
    return "—" if v is None else f"{v:.{digits}f}"


def _label(r):
    q = r.get("quantile")
    label = r["method"]
    if r["method"].startswith("cap_and_spill"):
        label = f"{r['method']} q={q} (C={r.get('capacity')}, S={r.get('spill_capacity')})"
    if r.get("placement"):
        label += f" [replicated: {r['placement']}]"
    return label


def write_report(json_path: str) -> str:
    with open(json_path) as f:
        data = json.load(f)
    meta, results = data["meta"], data["results"]
    lines = [f"# MoE dispatch latency: {meta['devices']}", "",
             f"- date: {meta['date']}", f"- command: `{portable_command(meta['command'])}`",
             f"- jax {meta['jax']}, moe_jax {meta['moe_jax']}, Python {meta['python']}",
             *([f"- code: commit {meta['commit']}, sources {meta['moe_jax_source_sha256']}, "
                f"extensions {meta.get('extension_sha256')}"] if "commit" in meta else []),
             f"- d={meta['hidden']} bf16, E={meta['experts']}, top-{meta['top_k']}, "
             f"{meta['steps']} measured steps per row, fresh routing every step "
             "(calibrated Mixtral-8x7B trace model"
             + (f", expert popularity skew {meta['skew']:g} instead of its 0.675)"
                if meta.get("skew", 0.675) != 0.675 else ")"),
             "- all-to-all bandwidth measured in the same run: "
             + (f"{meta['alltoall_bandwidth_GBps_per_gpu']:.1f} GB/s sent per GPU"
                if meta.get("alltoall_bandwidth_GBps_per_gpu") else
                "none (one device: no row leaves it, no byte floor; `dispatch_combine` "
                "takes its local path whatever the transport, so the `:nvlink` dc rows "
                "run no NVLink kernels, while the dispatch rows and the fp8 rows do)"),
             f"- XLA_FLAGS: `{meta['xla_flags'] or '(none)'}`",
             *([f"- hot-expert replication on every row: {meta['replication']['text']}; "
                "each pick is mapped to a slot inside the timed step as `moe_layer(..., "
                "placement=)` maps it; C, S, `floor` and `busiest` come from the "
                "slot-level rows"] if meta.get("replication") else []),
             ""]
    if meta.get("partial"):
        lines += ["**Partial run** (stopped before every configuration ran).", ""]
    if meta.get("timing") == "loop":
        lines += ["Timing `loop`: all measured steps run inside one jitted fori_loop "
                  "(fresh routing per step, no host work between steps); `mean` is the "
                  "median over 3 such runs of their mean per step, `p99` the slowest "
                  "run (no per-step percentiles in this mode)"
                  + (f"; the loop body holds {meta['loop_unroll']} steps."
                     if meta.get("loop_unroll", 1) > 1 else ".")
                  + (" Each step adds only its output's first row to the loop's result "
                     "(`--consume=first_row`): no read of the delivered rows is timed."
                     if meta.get("consume") == "first_row" else
                     " Each step adds the sum of its whole output to the loop's result, "
                     "so a read of every delivered row (a dispatch's padded receive "
                     "buffer included) is timed."), ""]
    lines += ["Latencies in microseconds, timed per step on the host around a "
              "synchronous call (includes JAX's dispatch overhead) unless the timing "
              "is `loop`; `pipelined` is the mean of back-to-back calls. `floor` is the time to move the "
              "actual rows there and back at the measured bandwidth (mean rows per GPU); "
              "`busiest` the same for the GPU that sends or receives the most rows "
              "(no dispatch can beat that GPU's links). Overflow: "
              "fraction of per-peer counts above C (spill pass used); fallback: "
              "above C+S.", ""]
    by_phase = defaultdict(list)
    for r in results:
        by_phase[r["phase"]].append(r)
    for phase in ("dc", "dispatch", "combine", "layer"):
        rows = by_phase.get(phase)
        if not rows:
            continue
        title = {"dc": "dispatch + combine (identity experts)", "dispatch": "dispatch",
                 "combine": "combine", "layer": "whole MoE layer (SwiGLU experts)"}[phase]
        lines += [f"## {title}", "",
                  "| T/GPU | method | mean | median | p95 | p99 | pipelined | vs max_counts "
                  "(mean) | floor | busiest | overflow | fallback |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        base = {r["tokens"]: r["mean_us"] for r in rows
                if r["method"] == "max_counts" and "error" not in r}
        for r in sorted(rows, key=lambda r: (r["tokens"], r["method"], r.get("quantile") or 0)):
            if "error" in r:
                lines.append(f"| {r['tokens']} | {_label(r)} | failed: "
                             f"{r['error'][:80]} | | | | | | | | | |")
                continue
            ratio = base.get(r["tokens"])
            ratio = None if ratio is None else ratio / r["mean_us"]
            lines.append(
                f"| {r['tokens']} | {_label(r)} | {_fmt(r['mean_us'])} | {_fmt(r['median_us'])} "
                f"| {_fmt(r['p95_us'])} | {_fmt(r['p99_us'])} | {_fmt(r['pipelined_mean_us'])} "
                f"| {_fmt(ratio, 2)}x | {_fmt(r.get('byte_floor_dc_us'))} "
                f"| {_fmt(r.get('busiest_floor_dc_us'))} "
                f"| {_fmt(r.get('overflow_rate'), 4)} | {_fmt(r.get('fallback_rate'), 6)} |")
        lines.append("")
    md_path = json_path[:-len(".json")] + ".md"
    with open(md_path, "w") as f:
        f.write("\n".join(lines))
    _plot(results, json_path[:-len(".json")] + "_cdf.png", meta)
    return md_path


def _plot(results, path, meta):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return
    rows = [r for r in results if r["phase"] == "dc" and "samples_us" in r]
    tokens = sorted({r["tokens"] for r in rows})
    if not tokens:
        return
    fig, axes = plt.subplots(1, len(tokens), figsize=(4 * len(tokens), 3.5), squeeze=False)
    for ax, t in zip(axes[0], tokens):
        for r in rows:
            if r["tokens"] != t:
                continue
            s = np.sort(r["samples_us"])
            ax.plot(s, np.arange(1, len(s) + 1) / len(s), label=_label(r), lw=1)
        ax.set_title(f"T={t} tokens/GPU")
        ax.set_xlabel("dispatch+combine latency (us)")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("CDF")
    axes[0][-1].legend(fontsize=6, loc="lower right")
    fig.suptitle(f"{meta['devices']}, d={meta['hidden']}, E={meta['experts']}, "
                 f"top-{meta['top_k']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    print(write_report(sys.argv[1]))

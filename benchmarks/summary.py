"""Summary tables of dispatch_bench result files, one run per table.

    python -m benchmarks.summary docs/benchmarks/dispatch/dispatch_*.json \
        --out docs/benchmarks/dispatch/SUMMARY.md

Mean dispatch+combine latency per tokens-per-GPU for each method (cap_and_spill
at q = 0.99), the ratios the targets are stated in, and the byte floor. Every
table is built from one result file (one run: one device, one set of XLA
flags, one build) and names it; cells of different runs never share a table,
so a ratio always compares numbers measured together.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.provenance import portable_command

METHODS = [("max_counts", None), ("cap_and_spill:lax", 0.99), ("cap_and_spill:nccl", 0.99),
           ("ragged", None), ("gshard", None), ("cap_and_spill:nvlink", 0.99),
           ("ragged:nvlink", None)]
def _rows(path):
    """(cells keyed by (timing, phase, tokens, method, quantile), meta) of one run."""
    with open(path) as f:
        data = json.load(f)
    meta = data["meta"]
    timing = meta.get("timing", "host")
    unroll = meta.get("loop_unroll", 1)
    if timing == "loop" and unroll > 1:
        timing = f"loop_x{unroll}"
    rows = {}
    for r in data["results"]:
        if "error" in r:
            continue
        rows[(timing, r["phase"], r["tokens"], r["method"], r.get("quantile"))] = r
    return rows, meta


TIMINGS = {"loop": "device-side: all steps in one jitted loop, mean per step",
           "host": "host-timed: each step around a synchronous call"}


def _timing_text(timing: str) -> str:
    if timing.startswith("loop_x"):
        return (f"device-side: all steps in one jitted loop, {timing[len('loop_x'):]} steps "
                "per loop iteration, mean per step")
    return TIMINGS[timing]


def _cell(r):
    return "—" if r is None else f"{r['mean_us']:.0f}"


def _gpu_count(device: str) -> int:
    head = device.split(" x ", 1)[0]
    return int(head) if head.isdigit() else 1


def summarize(paths) -> str:
    """Tables per run (most GPUs first, then by date), each from one file."""
    runs = [(path, *_rows(path)) for path in paths]
    runs.sort(key=lambda r: (-_gpu_count(r[2]["devices"]), r[2]["devices"], r[2]["date"]))
    return "\n".join(_summarize_run(path, rows, meta) for path, rows, meta in runs)


def _summarize_run(path, rows, meta) -> str:
    tokens = sorted({k[2] for k in rows})
    flags = meta.get("xla_flags") or "none"
    out = [f"### {meta['devices']}: `{path}`", "",
           f"Run of {meta['date']}: `{portable_command(meta['command'])}`; XLA flags: {flags}; "
           f"jax {meta['jax']}; d={meta['hidden']} bf16, E={meta['experts']}, "
           f"top-{meta['top_k']}, {meta['steps']} steps per cell (full tables, p50/p95/p99, "
           "overflow rates, CDF plots in the file).", ""]
    if meta.get("replication"):
        out += [f"Hot-expert replication on every cell of this run: "
                f"{meta['replication']['text']}.", ""]
    unrolled = sorted({k[0] for k in rows if k[0].startswith("loop_x")})
    for timing, phase, title in [(t, p, n) for t in (*unrolled, "loop", "host")
                                 for p, n in (("dc", "dispatch + combine"),
                                              ("layer", "whole layer"))]:
        if not any(k[0] == timing and k[1] == phase for k in rows):
            continue
        out += [f"Mean {title} latency, microseconds per step, {_timing_text(timing)} "
                "(cap_and_spill at q=0.99):", "",
                "| T/GPU | " + " | ".join(m for m, _ in METHODS)
                + " | max_counts / cap_and_spill:lax | ragged / cap_and_spill:lax"
                + " | max_counts / cap_and_spill:nvlink | ragged / cap_and_spill:nvlink"
                + " | fallback guard (lax minus noguard)"
                + (" | byte floor | busiest-GPU floor |" if phase == "dc" else " |"),
                "|" + " --- |" * (len(METHODS) + 6 + 2 * (phase == "dc"))]
        for t in tokens:
            cells = [rows.get((timing, phase, t, m, q)) for m, q in METHODS]
            if not any(cells):
                continue
            base, cas, rag, nv = cells[0], cells[1], cells[3], cells[5]
            ratio = lambda a, b: f"{a['mean_us'] / b['mean_us']:.2f}x" if a and b else "—"
            r1, r2 = ratio(base, cas), ratio(rag, cas)
            r3, r4 = ratio(base, nv), ratio(rag, nv)
            noguard = rows.get((timing, phase, t, "cap_and_spill:noguard", 0.99))
            guard = (f"{cas['mean_us'] - noguard['mean_us']:+.0f}" if cas and noguard else "—")
            line = (f"| {t} | " + " | ".join(_cell(c) for c in cells)
                    + f" | {r1} | {r2} | {r3} | {r4} | {guard} |")
            if phase == "dc":
                floor = next((c["byte_floor_dc_us"] for c in cells if c), None)
                line += f" {floor:.0f} |" if floor else " — |"
                busiest = next((c.get("busiest_floor_dc_us") for c in cells if c), None)
                line += f" {busiest:.0f} |" if busiest else " — |"
            out.append(line)
        out.append("")
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser(description="Summary tables, one run per table.")
    parser.add_argument("paths", nargs="+", help="dispatch_bench JSON files")
    parser.add_argument("--out", help="write the tables to this markdown file")
    args = parser.parse_args()
    text = summarize(args.paths)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Dispatch benchmark summary\n\nOne table set per run: a ratio only "
                    "compares numbers measured in the same run.\n\n" + text)
    print(text)


if __name__ == "__main__":
    main()

"""Summary table across dispatch_bench result files (the README's table).

    python -m benchmarks.summary docs/benchmarks/dispatch_*.json \
        --out docs/benchmarks/SUMMARY.md --readme README.md

Mean dispatch+combine latency per tokens-per-GPU for each method (cap_and_spill
at q = 0.99), the ratios the targets are stated in, and the byte floor.
With --readme, replaces the text between the benchmark-summary markers.
"""

from __future__ import annotations

import argparse
import json
import re

METHODS = [("max_counts", None), ("cap_and_spill:lax", 0.99), ("cap_and_spill:nccl", 0.99),
           ("ragged", None), ("gshard", None), ("cap_and_spill:nvlink", 0.99),
           ("ragged:nvlink", None)]
START, END = "<!-- benchmark-summary:start -->", "<!-- benchmark-summary:end -->"


def _rows(paths):
    rows, sources = {}, []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        sources.append((path, data["meta"]))
        timing = data["meta"].get("timing", "host")
        unroll = data["meta"].get("loop_unroll", 1)
        if timing == "loop" and unroll > 1:
            timing = f"loop_x{unroll}"
        for r in data["results"]:
            if "error" in r:
                continue
            rows[(timing, r["phase"], r["tokens"], r["method"], r.get("quantile"))] = r
    return rows, sources


TIMINGS = {"loop": "device-side: all steps in one jitted loop, mean per step",
           "host": "host-timed: each step around a synchronous call"}


def _timing_text(timing: str) -> str:
    if timing.startswith("loop_x"):
        return (f"device-side: all steps in one jitted loop, {timing[len('loop_x'):]} steps "
                "per loop iteration, mean per step")
    return TIMINGS[timing]


def _cell(r):
    return "—" if r is None else f"{r['mean_us']:.0f}"


def _device(path) -> str:
    with open(path) as f:
        return json.load(f)["meta"]["devices"]


def _gpu_count(device: str) -> int:
    head = device.split(" x ", 1)[0]
    return int(head) if head.isdigit() else 1


def summarize(paths) -> str:
    """One set of tables per device (most GPUs first), never mixing devices in a cell."""
    by_device = {}
    for path in paths:
        by_device.setdefault(_device(path), []).append(path)
    order = sorted(by_device, key=lambda d: (-_gpu_count(d), d))
    if len(order) == 1:
        return _summarize_device(by_device[order[0]])
    return "\n".join(f"### {device}\n\n" + _summarize_device(by_device[device])
                     for device in order)


def _summarize_device(paths) -> str:
    rows, sources = _rows(paths)
    tokens = sorted({k[2] for k in rows})
    out = []
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
    devices = sorted({m["devices"] for _, m in sources})
    out.append(f"Device: {', '.join(devices)}; jax {sources[0][1]['jax']}; d={sources[0][1]['hidden']}"
               f" bf16, E={sources[0][1]['experts']}, top-{sources[0][1]['top_k']}, "
               f"{sources[0][1]['steps']} steps per cell. Sources (full tables, p50/p95/p99, "
               "overflow rates, CDF plots):")
    for path, meta in sources:
        out.append(f"- `{path}` ({meta['date']}): `{meta['command']}`")
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--out")
    parser.add_argument("--readme")
    args = parser.parse_args()
    text = summarize(args.paths)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Dispatch benchmark summary\n\n" + text)
    if args.readme:
        with open(args.readme) as f:
            readme = f.read()
        block = f"{START}\n{text}{END}"
        readme, n = re.subn(re.escape(START) + r"[\s\S]*?" + re.escape(END), block, readme)
        if n != 1:
            raise SystemExit(f"{args.readme}: no benchmark-summary markers")
        with open(args.readme, "w") as f:
            f.write(readme)
    print(text)


if __name__ == "__main__":
    main()

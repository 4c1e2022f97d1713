"""Routing-only async vs. sync EP at production shapes: throughput at matched ITL.

    python benchmarks/async_ep_routesim_bench.py --workload=T1 --out=docs/benchmarks/async_ep
    python benchmarks/async_ep_routesim_bench.py --workload=T2 --out=docs/benchmarks/async_ep

No model math runs (moe_jax.async_ep.routesim): routes come from a trace
model, every layer execution costs what the cost envelope says for its rows
(expert FFN: the recorded one-GPU CUTLASS bf16 measurement at the Mixtral
expert shape, docs/benchmarks/experts/expert_ffn_1xH100.json, interpolated;
attention and sampler: a documented MQA-like model, not measured).

Workloads:
  T1  persistent skew (s = 3, the same hot expert in every block), top-2,
      4 devices, 8 experts (expert e on device e % 4), 16 blocks, colocated.
  T2  the AMoE paper's regime: 8 devices, 8 experts (one per device), top-1,
      16 blocks, s = 3 with the hot expert rotated per block; plus the
      paper's layout (A attention devices + 8 expert devices, A from the
      attention/expert cost ratio) against the baselines on A + 8 devices.

Engines: sync (ideal barrier-synchronous), sync-repl (the same with the
hottest expert of each block replicated), async-defrag (Algorithm 1),
async-mtfs, async-flfs (the named baselines; only at points with at most
--baseline_max_slots slots), async-hold (the cost-aware hold scheduler:
whole waves, cheapest execution first; wave-aligned admission) and
async-hold-<G>w for each G of --wave_groups (the same with each rank's slots
in G wave groups that never share an execution, group g started g / G of a
sync ITL later; in the colocated group (--phase), each group is kept at a phase
offset chosen from the trace model's expected expert load so that the groups
meet their heavy experts on different devices, the group furthest behind its
place running first on every device).

Every engine of a group runs the same requests, routes and KV slots at each
point of the sweep (closed loop at every --slots, and Poisson arrivals at
--rate_fractions of the synchronous engine's closed-loop request rate at
--rate_slots). Statistics are taken over the steady window only (from the
admission that replaces the first wave plus 10% of the requests to the last
admission). The frontier: the synchronous engine's 90%-of-peak point (the
sync point with >= 90% of its peak throughput and the lowest mean ITL) fixes
a mean and a p99 ITL; each engine reports its best throughput among points
at or under them (within --itl_tolerance, 1%), with the utilization bound of the sync engine at that
point (1/util_max colocated, 1/util_mean disaggregated).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.provenance import commit, portable_command, source_digest  # noqa: E402
from moe_jax.async_ep import routesim as rs  # noqa: E402
from moe_jax.async_ep.costs import ProductionCosts  # noqa: E402
from moe_jax.async_ep.schedulers import make_scheduler  # noqa: E402

RECORD = "docs/benchmarks/experts/expert_ffn_1xH100.json"

WORKLOADS = {
    "T1": dict(devices=4, experts=8, top_k=2, blocks=16, skew=3.0, mode="persistent",
               paper_layout=False),
    "T2": dict(devices=8, experts=8, top_k=1, blocks=16, skew=3.0, mode="rotated",
               paper_layout=True),
}


def add_gpu_costs_flag(p):
    """--gpu_costs: where the layer costs come from (see layer_costs)."""
    p.add_argument("--gpu_costs", default=None,
                   help="a benchmarks/async_ep_costs_gpu.py record: every kind's cost from it "
                        "(default: the expert record and the modelled attention / sampler)")


def layer_costs(args) -> ProductionCosts:
    """The cost envelopes: every kind from --gpu_costs when given, else the
    expert-FFN record and the modelled attention and sampler."""
    return ProductionCosts(RECORD, gpu_costs=args.gpu_costs)


def engines_for(group: str, args):
    out = _engines_for(group, args)
    if args.engines:
        out = [e for e in out if e[0] in args.engines or e[0].replace("-disagg", "") in args.engines]
    return out


def _engines_for(group: str, args):
    hold = dict(hold_s=args.hold_s, slack=args.slack, priority=args.priority)
    suffix = "" if group == "colocated" else "-disagg"
    phase = args.phase == "all" or args.phase == group
    wave_sched = dict(hold, priority="phase") if phase else hold
    waves = [(f"async-hold-{g}w{suffix}", "hold",
              {**wave_sched, "wave_groups": g, "separate_groups": True, "phase": phase})
             for g in args.wave_groups]
    if group == "colocated":
        return [("sync", "sync", {}), ("sync-repl", "sync", {"replicate": args.replicate}),
                ("async-defrag", "defrag", {}), ("async-mtfs", "mtfs", {}),
                ("async-flfs", "flfs", {}), ("async-hold", "hold", hold)] + waves
    return [("sync", "sync", {}), ("sync-repl", "sync", {"replicate": args.replicate}),
            ("async-defrag-disagg", "defrag", {}), ("async-hold-disagg", "hold", hold)] + waves


ENGINE_KEYS = ("wave_groups", "separate_groups", "phase")
NAMED_BASELINES = ("defrag", "mtfs", "flfs")


def run_engine(setup, kind, kw, arr, ln, routes, off, sync_itl_s=None):
    """One engine on one point. Wave groups start staggered by the sync
    engine's mean ITL at the same point over the number of groups."""
    if kind == "sync":
        return rs.run_sync(setup, arr, ln, routes, off, **kw)
    eng = {k: v for k, v in kw.items() if k in ENGINE_KEYS}
    sched = make_scheduler(kind, **{k: v for k, v in kw.items() if k not in ENGINE_KEYS})
    if eng.get("wave_groups", 1) > 1 and sync_itl_s:
        eng["stagger_s"] = sync_itl_s / eng["wave_groups"]
    if eng.pop("phase", False):
        eng["phase_offsets"] = rs.phase_offsets(setup, eng.get("wave_groups", 1))
    return rs.run_async(setup, sched, arr, ln, routes, off, wave_admission=(kind == "hold"),
                        **eng)


def sweep_group(group, base, costs, trace, args, log):
    """Runs every engine of the group at every point; returns (points, rows)."""
    rows = []
    points = [(s, None) for s in args.slots]
    engines = engines_for(group, args)
    sync_rate = None
    for slots, frac in points + [(args.rate_slots, f) for f in args.rate_fractions]:
        n_req = max(args.num_requests, 3 * slots)
        if frac is None:
            rate = None
        else:
            if sync_rate is None:
                raise RuntimeError("rate_slots must be one of --slots")
            rate = frac * sync_rate
        arr, ln = rs.Workload(n_req, tuple(args.new_tokens), rate, seed=args.seed).requests()
        routes, off = rs.make_routes(trace, ln, args.seed + 1)
        digest = rs.route_digest(routes, off, ln)
        sync_itl_s = None
        for label, kind, kw in engines:
            if kind in NAMED_BASELINES and slots > args.baseline_max_slots:
                continue
            setup = rs.Setup(**{**base, "total_slots": slots})
            if kind == "sync":
                setup = rs.Setup(**{**base, "total_slots": slots, "layout": "colocated",
                                    "num_ranks": base["num_devices"]})
            t = time.perf_counter()
            res = run_engine(setup, kind, kw, arr, ln, routes, off, sync_itl_s)
            wall = time.perf_counter() - t
            if not res.finished or not (res.route_counts == digest).all():
                raise RuntimeError(f"{label}: unfinished or other routes")
            st = rs.stats(res, slots)
            if label == "sync":
                sync_itl_s = st["itl_mean_ms"] * 1e-3
            st["by_kind"] = {k: dict(executions=v[0], rows=v[1], busy_s=v[2])
                             for k, v in res.by_kind.items()}
            st.update(engine=label, group=group, slots=slots, rate_fraction=frac,
                      rate_req_s=rate, num_requests=n_req, wall_s=wall,
                      layout=setup.layout if kind != "sync" else "colocated")
            rows.append(st)
            log(f"{group:>9} {label:>20} slots {slots:5d} rate {frac} tok/s "
                f"{st['tokens_per_s']:9.0f} itl {st['itl_mean_ms']:.2f}/{st['itl_p99_ms']:.2f} ms "
                f"util max/mean {st['util_max']:.2f}/{st['util_mean']:.2f} ({wall:.1f} s)")
            if label == "sync" and frac is None and slots == args.rate_slots:
                # requests per second the sync engine completes in closed loop
                sync_rate = st["tokens_per_s"] / float(np.mean(ln))
    return rows


def frontier(rows, itl_tolerance=0.01):
    """Per engine: best throughput at the sync 90%-of-peak point's mean / p99 ITL."""
    sync = [r for r in rows if r["engine"] == "sync"]
    peak = max(r["tokens_per_s"] for r in sync)
    ref = min((r for r in sync if r["tokens_per_s"] >= 0.9 * peak),
              key=lambda r: r["itl_mean_ms"])
    out = {"sync_peak_tokens_per_s": peak, "ref": {k: ref[k] for k in (
        "slots", "rate_fraction", "tokens_per_s", "itl_mean_ms", "itl_p99_ms", "util_max",
        "util_mean")}, "engines": []}
    closed = sorted((r for r in sync if r["rate_fraction"] is None), key=lambda r: r["slots"])
    if len(closed) >= 2:
        a, b = closed[-2], closed[-1]
        gain = b["tokens_per_s"] / a["tokens_per_s"] - 1.0
        out["saturation"] = (f"Sync closed-loop throughput grows {gain:.0%} from {a['slots']} to "
                             f"{b['slots']} slots (the largest swept) while its mean ITL grows "
                             f"{b['itl_mean_ms'] / a['itl_mean_ms'] - 1.0:.0%}.")
    else:
        out["saturation"] = ""
    tol = 1.0 + itl_tolerance
    for name in dict.fromkeys(r["engine"] for r in rows):
        mine = [r for r in rows if r["engine"] == name]
        at_mean = [r for r in mine if r["itl_mean_ms"] <= ref["itl_mean_ms"] * tol]
        at_p99 = [r for r in mine if r["itl_p99_ms"] <= ref["itl_p99_ms"] * tol]
        best_mean = max(at_mean, key=lambda r: r["tokens_per_s"]) if at_mean else None
        best_p99 = max(at_p99, key=lambda r: r["tokens_per_s"]) if at_p99 else None
        layout = mine[0]["layout"]
        bound = 1.0 / (ref["util_max"] if layout == "colocated" else ref["util_mean"])
        out["engines"].append(dict(
            engine=name, layout=layout, bound=bound,
            at_mean=None if best_mean is None else dict(
                tokens_per_s=best_mean["tokens_per_s"], slots=best_mean["slots"],
                rate_fraction=best_mean["rate_fraction"], itl_mean_ms=best_mean["itl_mean_ms"],
                vs_sync=best_mean["tokens_per_s"] / ref["tokens_per_s"]),
            at_p99=None if best_p99 is None else dict(
                tokens_per_s=best_p99["tokens_per_s"], slots=best_p99["slots"],
                rate_fraction=best_p99["rate_fraction"], itl_p99_ms=best_p99["itl_p99_ms"],
                vs_sync=best_p99["tokens_per_s"] / ref["tokens_per_s"]),
            peak_tokens_per_s=max(r["tokens_per_s"] for r in mine)))
    return out


def markdown(meta, groups):
    lines = [f"# Routing-only simulation, workload {meta['workload']}", "",
             f"- date: {meta['date']}", f"- command: `{meta['command']}`",
             f"- commit: {meta['commit']}; sources {meta['source_digest']}",
             f"- host: {meta['host']}; simulation wall time {meta['wall_s']:.0f} s",
             f"- workload: `{json.dumps(meta['workload_config'])}`",
             f"- flags: `{json.dumps(dict(meta['flags'], out='OUT_DIR'))}`",
             f"- expert cost: {meta['costs']['model']['expert']}",
             f"- attention cost: {meta['costs']['model']['attention']}"
             + (" (MODELLED, not measured)" if meta['costs']['model']['attention'].startswith(
                 "modelled") else ""),
             f"- sampler cost: {meta['costs']['model']['sampler']}"
             + (" (MODELLED)" if meta['costs']['model']['sampler'].startswith("modelled") else ""),
             f"- message latency {meta['flags']['latency_us']} us per cross-device message "
             "(async) and per all-to-all (sync, two per block)", ""]
    for g in groups:
        f = g["frontier"]
        ref = f["ref"]
        lines += [f"## Group `{g['group']}` ({g['num_devices']} devices"
                  + (f", {g['attention_devices']} attention + {g['num_devices'] - g['attention_devices']} expert devices for the async engines" if g.get("attention_devices") else "")
                  + ")", "",
                  f"Sync peak {f['sync_peak_tokens_per_s']:.0f} tokens/s; its 90%-of-peak point: "
                  f"{ref['slots']} slots, rate {ref['rate_fraction']}, {ref['tokens_per_s']:.0f} "
                  f"tokens/s at ITL mean {ref['itl_mean_ms']:.3f} ms / p99 {ref['itl_p99_ms']:.3f} "
                  f"ms; sync util there max {ref['util_max']:.2f}, mean {ref['util_mean']:.2f}. "
                  f"{f['saturation']}", "",
                  "| engine | layout | tokens/s at sync mean ITL | vs sync | tokens/s at sync p99 ITL | vs sync | bound | of bound (mean) | peak tokens/s (any ITL) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for e in f["engines"]:
            m, p = e["at_mean"], e["at_p99"]
            lines.append(
                f"| {e['engine']} | {e['layout']} | "
                + (f"{m['tokens_per_s']:.0f} | {m['vs_sync']:.2f}x" if m else "none | -") + " | "
                + (f"{p['tokens_per_s']:.0f} | {p['vs_sync']:.2f}x" if p else "none | -") + " | "
                + f"{e['bound']:.2f}x | " + (f"{m['vs_sync'] / e['bound']:.0%}" if m else "-")
                + f" | {e['peak_tokens_per_s']:.0f} |")
        lines += ["", "All points:", "",
                  "| engine | slots | rate (x sync) | tokens/s | ITL mean ms | ITL p99 ms | util max | util mean | executions | mean batch | attention executions (rows each) | expert executions (rows each) | expert busy s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in g["rows"]:
            a, x = r["by_kind"]["attention"], r["by_kind"]["expert"]
            lines.append(f"| {r['engine']} | {r['slots']} | {r['rate_fraction']} | "
                         f"{r['tokens_per_s']:.0f} | {r['itl_mean_ms']:.3f} | {r['itl_p99_ms']:.3f} | "
                         f"{r['util_max']:.2f} | {r['util_mean']:.2f} | {r['executions']} | "
                         f"{r['mean_batch']:.1f} | {a['executions']} ({a['rows'] / max(a['executions'], 1):.0f}) | "
                         f"{x['executions']} ({x['rows'] / max(x['executions'], 1):.0f}) | "
                         f"{x['busy_s']:.3f} |")
        lines += ["", "Executions, rows and busy seconds by kind count the whole run (every "
                  "engine runs the same tokens and routes); utilization counts the steady window.", ""]
        lines.append("")
    c = meta["costs"]
    lines += ["## Cost envelope (us per execution by padded rows, selected buckets)", "",
              "| rows | expert | attention | sampler |",
              "|---:|---:|---:|---:|"]
    for i, b in enumerate(c["buckets"]):
        if b in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048) or i == len(c["buckets"]) - 1:
            lines.append(f"| {b} | {c['expert_s'][i] * 1e6:.1f} | {c['attention_s'][i] * 1e6:.1f} "
                         f"| {c['sampler_s'][i] * 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--slots", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 6144])
    p.add_argument("--rate_slots", type=int, default=2048)
    p.add_argument("--rate_fractions", type=float, nargs="*", default=[0.8])
    p.add_argument("--num_requests", type=int, default=2000)
    p.add_argument("--new_tokens", type=int, nargs=2, default=[16, 48])
    p.add_argument("--latency_us", type=float, default=10.0)
    p.add_argument("--replicate", type=int, default=1)
    p.add_argument("--hold_s", type=float, default=2e-3)
    p.add_argument("--slack", type=float, default=0.02,
                   help="the hold scheduler's split slack (HoldScheduler's default)")
    p.add_argument("--priority", choices=["shortest", "score"], default="shortest",
                   help="the hold scheduler's order among the queues it may run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--itl_tolerance", type=float, default=0.01,
                   help="an engine's point matches the sync ITL when within this fraction above")
    add_gpu_costs_flag(p)
    p.add_argument("--wave_groups", type=int, nargs="*", default=[2, 3],
                   help="an async-hold-<G>w engine for each G: the hold scheduler with each rank's "
                        "slots in G wave groups that never share an execution")
    p.add_argument("--phase", default="colocated", choices=["colocated", "paper", "all", "none"],
                   help="groups whose wave-group engines keep their groups at the phase offsets "
                        "(routesim.phase_offsets) with the hold scheduler's priority='phase'; "
                        "the others run cheapest execution first, groups placed by the start "
                        "stagger only")
    p.add_argument("--baseline_max_slots", type=int, default=1024,
                   help="defrag, MTFS and FLFS run only at points with at most this many slots "
                        "(they fragment waves into many small executions and are slow to simulate)")
    p.add_argument("--suffix", default="", help="appended to the record's file name")
    p.add_argument("--engines", nargs="*", default=None,
                   help="only these engines (names as in the table; sync is always needed)")
    args = p.parse_args(argv)
    w = WORKLOADS[args.workload]
    costs = layer_costs(args)
    trace = rs.TraceModel(w["experts"], w["blocks"], w["top_k"], w["skew"], w["mode"],
                          seed=args.seed)
    start = time.perf_counter()
    log = lambda s: print(s, flush=True)  # noqa: E731
    base = dict(trace=trace, costs=costs, num_devices=w["devices"], num_ranks=w["devices"],
                total_slots=0, layout="colocated", latency_s=args.latency_us * 1e-6)
    groups = []
    rows = sweep_group("colocated", base, costs, trace, args, log)
    groups.append(dict(group="colocated", num_devices=w["devices"], rows=rows,
                       frontier=frontier(rows, args.itl_tolerance)))
    if w["paper_layout"]:
        a = rs.choose_attention_devices(costs, w["experts"], w["top_k"], args.rate_slots,
                                        trace.shares())
        d = a + w["experts"]
        log(f"paper layout: {a} attention device(s) + {w['experts']} expert devices")
        base_d = {**base, "num_devices": d, "num_ranks": a, "layout": "disaggregated"}
        rows = sweep_group("paper", base_d, costs, trace, args, log)
        groups.append(dict(group="paper", num_devices=d, attention_devices=a, rows=rows,
                           frontier=frontier(rows, args.itl_tolerance)))
    meta = dict(workload=args.workload, workload_config=w, flags=vars(args),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=portable_command("python " + " ".join(sys.argv)), commit=commit(),
                source_digest=source_digest(), host=f"{platform.node()} ({os.cpu_count()} cores)",
                python=platform.python_version(), numpy=np.__version__,
                wall_s=time.perf_counter() - start, costs=costs.as_dict())
    text = markdown(meta, groups)
    print(text)
    if args.out:
        write_record(args.out, f"async_ep_routesim_{args.workload}{args.suffix}",
                     dict(meta=meta, groups=groups), text)


def write_record(out_dir: str, name: str, data: dict, text: str) -> None:
    """out_dir/name.json (data) and out_dir/name.md (text)."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, name)
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1, default=float)
    with open(stem + ".md", "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()

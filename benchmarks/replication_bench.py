"""Hot-expert replication from routing traces: busiest rank and capacity.

    python benchmarks/replication_bench.py --out=OUT_DIR

A host-side simulation (NumPy, no devices): for each trace set and EP size
P, every (layer, step) trace is dispatched under the replica choice rule of
moe_jax.replication (a pick goes to the replica on the sender's own rank,
else to replicas[hash32(token) % n]) and the rows each rank receives for all
the slots it holds (self rows included) are counted. Placements compared:

* ``none``: the unreplicated layout (expert e on rank e // (E / P));
* ``ema S=E/P+d``: a LoadTracker per layer (EMA, --alpha) updated online
  after every step; every --rebalance_every steps ``propose`` (with
  --num_replicated hottest experts as candidates) replaces the layer's
  placement, used from the next step on;
* ``oracle S=E/P+d``: ``propose`` on the step's own per-expert loads (perfect
  prediction; the bound for any load-predicting rebalancer), evaluated on
  every --oracle_every-th step only (it runs one proposal per trace);
* with --balanced, the balanced rule (``moe_layer(...,
  replica_choice="balanced")``: the step's own per-expert counts, all-gathered,
  level the holders' rows; no preference for the sender's replica) on
  ``spread S=E/P+d`` (``Placement.spread``, static: every expert's home
  plus the following ranks' spare slots) and on the EMA placements
  (``ema+balanced``).

Reported over the steps >= --warmup_steps (all layers): the busiest rank's
received rows over the mean rank's (mean over the (layer, step) traces, and
their 99th percentile), the fraction of traces within 1.15x, and the
cap-and-spill capacity C = moe_jax.calibrate(counts, quantile=0.99).capacity
of the per-(source rank, destination rank) counts (self pairs included).

With --layer_check=N, the first N counted traces of every row are also
dispatched by the layer's own code on P CPU devices (``slot_ids`` and
``dispatch_combine`` under ``shard_map``, the placement a jitted input) and
the rows each rank's slots receive must equal the simulation's (the run
stops otherwise); the tables say how many traces were checked.

Trace sets:

* ``mixtral``: ``generate_traces`` with the calibrated Mixtral-8x7B preset
  (E = 8, top-2, ~20 tokens per rank, expert popularity lognormal with
  skew 0.675 drawn afresh for every (layer, step)), at P = 4 and 8;
* ``mixtral_T<n>``: the same popularity model with --fixed_tokens tokens
  per rank per step (separates sampling noise from skew);
* ``exp<s>``: a persistent exponential skew: per layer a random order of the
  experts, router logits ``-s * position / E`` plus Gumbel noise (top-k
  Plackett-Luce, so the first pick's probability is ~ exp(-s * position /
  E)), fixed over the steps; token counts from the calibrated mixture.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks.provenance import code_meta, portable_command  # noqa: E402
from moe_jax.calibration import calibrate  # noqa: E402
from moe_jax.replication import (LoadTracker, Placement, choose_balanced_np,  # noqa: E402
                                 choose_replica_np, propose)
from moe_jax.traces import RoutingTrace, TraceModel, generate_traces, sample_routing  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Folder for the JSON and markdown (required).")
flags.DEFINE_string("tag", "replication_cpu", "File name stem of the results.")
flags.DEFINE_list("ranks", ["4", "8"], "EP sizes P.")
flags.DEFINE_list("extra_slots", ["1", "2"], "Spare slots per rank (S = E/P + d).")
flags.DEFINE_integer("num_layers", 8, "Layers per trace set (each its own placement).")
flags.DEFINE_integer("num_steps", 1000, "Steps per trace set.")
flags.DEFINE_integer("fixed_tokens", 256, "Tokens per rank of the mixtral_T<n> set (0: skip).")
flags.DEFINE_list("exp_skews", ["2.0"], "Persistent exponential skews (empty: none).")
flags.DEFINE_float("alpha", 0.99, "EMA weight of the past.")
flags.DEFINE_integer("num_replicated", 3, "Hottest experts that may get replicas.")
flags.DEFINE_integer("rebalance_every", 50, "Steps between rebalances.")
flags.DEFINE_integer("warmup_steps", 100, "Steps left out of the statistics.")
flags.DEFINE_integer("oracle_every", 10, "Oracle rows evaluate every n-th step (0: none).")
flags.DEFINE_float("target", 1.15, "Busiest-over-mean target reported against.")
flags.DEFINE_integer("seed", 0, "Trace seed.")
flags.DEFINE_bool("balanced", True, "Also rows of the balanced rule (spread and EMA placements).")
flags.DEFINE_integer("layer_check", 8, "Traces per row also dispatched by the layer's code "
                     "on CPU devices, whose per-rank rows must equal the simulation's (0: none).")

NUM_EXPERTS = 8
TOP_K = 2


def exp_skew_traces(num_ranks: int, skew: float, seed: int) -> list[RoutingTrace]:
    """Persistent exponential popularity (module docstring), step-major order."""
    rng = np.random.default_rng(seed)
    model = TraceModel(num_experts=NUM_EXPERTS, num_ranks=num_ranks, top_k=TOP_K)
    tps = model.sample_tokens_per_rank(FLAGS.num_steps, rng)
    biases = []
    for _ in range(FLAGS.num_layers):
        order = rng.permutation(NUM_EXPERTS)
        b = np.empty(NUM_EXPERTS, np.float32)
        b[order] = -skew * np.arange(NUM_EXPERTS) / NUM_EXPERTS
        biases.append(b)
    out, start = [], 0
    for s in range(FLAGS.num_steps):
        n = int(tps[s]) * num_ranks
        ids = np.arange(start, start + n, dtype=np.int64)
        for layer in range(FLAGS.num_layers):
            experts, gating = sample_routing(rng, n, NUM_EXPERTS, TOP_K, bias=biases[layer])
            out.append(RoutingTrace._trusted(layer, experts, gating, ids, num_ranks,
                                             NUM_EXPERTS, s))
        start += n
    return out


def trace_sets(num_ranks: int) -> list[tuple[str, str, list[RoutingTrace]]]:
    common = dict(num_experts=NUM_EXPERTS, num_ranks=num_ranks, top_k=TOP_K,
                  num_layers=FLAGS.num_layers, num_steps=FLAGS.num_steps, seed=FLAGS.seed)
    sets = [("mixtral", "calibrated Mixtral-8x7B generator (fresh lognormal skew 0.675 "
             "per layer and step, ~20 tokens per rank)", generate_traces(**common))]
    if FLAGS.fixed_tokens:
        sets.append((f"mixtral_T{FLAGS.fixed_tokens}",
                     f"the same popularity model, {FLAGS.fixed_tokens} tokens per rank",
                     generate_traces(tokens_per_rank=FLAGS.fixed_tokens, **common)))
    for s in FLAGS.exp_skews:
        skew = float(s)
        sets.append((f"exp{skew:g}", f"persistent exponential skew {skew:g} (per-layer "
                     "expert order fixed over the steps), calibrated token counts",
                     exp_skew_traces(num_ranks, skew, FLAGS.seed + 1)))
    return sets


def simulate(trace: RoutingTrace, placement: Placement, balanced: bool = False
             ) -> tuple[np.ndarray, np.ndarray]:
    """(received rows per rank [P], per-(source, destination) counts [P, P])."""
    P, S = placement.num_ranks, placement.slots_per_rank
    a = placement.as_arrays()
    src = trace.source_ranks()[:, None]
    if balanced:
        n = trace.num_tokens // P
        slot = choose_balanced_np(trace.experts.reshape(P, n * trace.top_k), None, None,
                                  a["replica_slots"], a["num_replicas"], S
                                  ).reshape(trace.experts.shape)
    else:
        slot = choose_replica_np(trace.token_idx[:, None], trace.experts, src, a["local_slot"],
                                 a["replica_slots"], a["num_replicas"])
    dest = (slot // S).astype(np.int64)
    pair = np.bincount((np.broadcast_to(src, dest.shape) * P + dest).reshape(-1),
                       minlength=P * P).reshape(P, P)
    return pair.sum(axis=0), pair


@functools.lru_cache(maxsize=None)
def _layer_rows_fn(num_ranks: int, slots: int, tokens: int, balanced: bool):
    """Jitted: (ids [P * tokens, k], token offsets [P], PlacementArrays) ->
    rows each slot received [P * S], by the layer's dispatch on P CPU devices."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.sharding import PartitionSpec as PS  # noqa: PLC0415

    from moe_jax.dispatch import DispatchContext, dispatch_combine  # noqa: PLC0415
    from moe_jax.mesh import expert_mesh  # noqa: PLC0415
    from moe_jax.replicated import balanced_slot_ids, slot_ids  # noqa: PLC0415
    from moe_jax.replication import PlacementArrays  # noqa: PLC0415

    mesh = expert_mesh(num_ranks, devices=jax.devices("cpu"))
    ctx = DispatchContext("ep", num_ranks, "lax", "custom_call", "cpu",
                          tuple(mesh.devices.flat))

    def body(ids, offset, placement):
        if balanced:
            slot = balanced_slot_ids(ids, placement, ctx.rank(), ctx.all_gather)
        else:
            slot = slot_ids(ids, placement, ctx.rank(), offset[0])
        x = jnp.ones((ids.shape[0], 8), jnp.float32)
        w = jnp.ones(ids.shape, jnp.float32)
        res = dispatch_combine(x, slot, w, lambda rows, sizes: rows, strategy="ragged",
                               ctx=ctx, experts_per_rank=slots, return_delivered=True)
        return res.delivered.group_sizes

    return jax.jit(jax.shard_map(body, mesh=mesh,
                                 in_specs=(PS("ep"), PS("ep"), PlacementArrays(*(PS(),) * 4)),
                                 out_specs=PS("ep")))


def layer_rows(trace: RoutingTrace, placement: Placement, tokens: int, balanced: bool = False
               ) -> np.ndarray | None:
    """Rows per rank [P] by the layer's dispatch (None when the trace's
    tokens are not contiguous ids per rank, as the layer numbers them)."""
    P, S = placement.num_ranks, placement.slots_per_rank
    n = trace.num_tokens // P
    idx = trace.token_idx.reshape(P, n)
    if not (idx == idx[:, :1] + np.arange(n)).all() or idx.max() >= 2 ** 31:
        return None
    ids = np.full((P, tokens, trace.top_k), -1, np.int32)
    ids[:, :n] = trace.experts.reshape(P, n, -1)
    sizes = _layer_rows_fn(P, S, tokens, balanced)(ids.reshape(P * tokens, -1),
                                        idx[:, 0].astype(np.int32),
                                        placement.device_arrays())
    return np.asarray(sizes).reshape(P, S).sum(axis=1)


def expert_counts(trace: RoutingTrace) -> np.ndarray:
    return np.bincount(trace.experts.reshape(-1), minlength=trace.num_experts)


def summarize(ratios: list[float], pairs: list[np.ndarray]) -> dict:
    r = np.asarray(ratios)
    cal = calibrate(np.stack(pairs), quantile=0.99)
    peers = calibrate(np.stack(pairs), quantile=0.99, include_self=False)
    return dict(traces=int(r.size), busiest_over_mean_mean=float(r.mean()),
                busiest_over_mean_p99=float(np.quantile(r, 0.99)),
                busiest_over_mean_max=float(r.max()),
                frac_within_target=float((r <= FLAGS.target).mean()),
                capacity_q99=int(cal.capacity), capacity_q99_peers=int(peers.capacity),
                count_mean=float(cal.count_mean),
                count_max=int(cal.count_max),
                frac_steps_spill_at_C=float(cal.frac_steps_spill))


def run_set(traces: list[RoutingTrace], num_ranks: int) -> list[dict]:
    P, E, L = num_ranks, NUM_EXPERTS, FLAGS.num_layers
    per_rank = E // P
    configs = [("none", per_rank, None)]
    for d in FLAGS.extra_slots:
        configs.append((f"ema S={per_rank}+{d}", per_rank + int(d), "ema"))
    if FLAGS.oracle_every:
        for d in FLAGS.extra_slots:
            configs.append((f"oracle S={per_rank}+{d}", per_rank + int(d), "oracle"))
    if FLAGS.balanced:
        for d in FLAGS.extra_slots:
            configs.append((f"spread+balanced S={per_rank}+{d}", per_rank + int(d), "spread"))
        for d in FLAGS.extra_slots:
            configs.append((f"ema+balanced S={per_rank}+{d}", per_rank + int(d), "ema"))
    rows = []
    tokens = max(tr.num_tokens // P for tr in traces)
    for name, S, mode in configs:
        t0 = time.perf_counter()
        balanced = "balanced" in name
        start = Placement.spread if mode == "spread" else Placement.default
        placements = [start(E, P, S) for _ in range(L)]
        trackers = [LoadTracker(E, FLAGS.alpha) for _ in range(L)]
        ratios, pairs, rebalances, checked = [], [], 0, 0
        for tr in traces:
            s, layer = tr.step, tr.layer
            counted = s >= FLAGS.warmup_steps
            if mode == "oracle":
                if not counted or s % FLAGS.oracle_every:
                    continue
                placement = propose(expert_counts(tr), P, S, FLAGS.num_replicated)
            else:
                placement = placements[layer]
            if counted:
                received, pair = simulate(tr, placement, balanced)
                if checked < FLAGS.layer_check:
                    by_layer = layer_rows(tr, placement, tokens, balanced)
                    if by_layer is not None:
                        if not np.array_equal(by_layer, received):
                            raise SystemExit(f"layer dispatch {by_layer.tolist()} != simulation "
                                             f"{received.tolist()} ({name}, step {s}, layer "
                                             f"{layer})")
                        checked += 1
                ratios.append(float(received.max() / (received.sum() / P)))
                pairs.append(pair)
            if mode == "ema":
                trackers[layer].update(expert_counts(tr))
                if (s + 1) % FLAGS.rebalance_every == 0:
                    placements[layer] = propose(trackers[layer], P, S, FLAGS.num_replicated)
                    rebalances += 1
        row = dict(placement=name, slots_per_rank=S, mode=mode or "none",
                   rebalances=rebalances, layer_checked=checked, **summarize(ratios, pairs),
                   seconds=round(time.perf_counter() - t0, 2))
        if mode == "ema":
            row["final_placements"] = [p.slot_expert.tolist() for p in placements]
        rows.append(row)
        print(f"  P={P} {name:14s} busiest/mean {row['busiest_over_mean_mean']:.3f} "
              f"(p99 {row['busiest_over_mean_p99']:.3f}) C={row['capacity_q99']} "
              f"[{row['seconds']} s]", flush=True)
    return rows


def markdown(meta: dict, results: list[dict]) -> str:
    lines = ["# Hot-expert replication from routing traces", "",
             f"- date: {meta['date']}; commit {meta['commit']}; sources "
             f"{meta['moe_jax_source_sha256']}",
             f"- command: `{portable_command(meta['command'])}`",
             f"- host simulation (NumPy) on {meta['machine']}; E = {NUM_EXPERTS}, top-"
             f"{TOP_K}, {meta['num_layers']} layers x {meta['num_steps']} steps per set, "
             f"statistics over steps >= {meta['warmup_steps']}",
             f"- ema: LoadTracker(alpha={meta['alpha']}) per layer, `propose(..., "
             f"num_replicated={meta['num_replicated']})` every {meta['rebalance_every']} "
             f"steps; oracle: `propose` on the step's own loads, every "
             f"{meta['oracle_every']}-th step",
             "- +balanced: the balanced rule (`replica_choice=\"balanced\"`: the step's "
             "per-expert counts level the holders' rows) on `Placement.spread` (static) or "
             "the EMA placements; the other rows use the local-then-hash rule",
             "- busiest/mean: the busiest rank's received rows (all its slots, self rows "
             "included) over the mean rank's, per (layer, step); C: cap-and-spill "
             "capacity at q = 0.99 of the per-(source, destination) counts "
             "(`calibrate(counts, quantile=0.99).capacity`; the rows a rank keeps for "
             "its own replica are self pairs)",
             f"- target: busiest within {meta['target']}x of the mean on the calibrated "
             "Mixtral traces",
             "- layer-checked: traces of the row also dispatched by the layer's code "
             "(`slot_ids` + `dispatch_combine`, ragged, on P CPU devices, the placement a "
             "jitted input), each with per-rank rows equal to the simulation's", ""]
    for res in results:
        lines += [f"## {res['set']}, EP {res['num_ranks']}", "", res["description"], "",
                  "| placement | S | busiest/mean (mean) | busiest/mean (p99) | "
                  f"traces within {meta['target']}x | C (q = 0.99) | C, self pairs left out | "
                  "max count | layer-checked |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in res["rows"]:
            lines.append(f"| {r['placement']} | {r['slots_per_rank']} | "
                         f"{r['busiest_over_mean_mean']:.3f} | "
                         f"{r['busiest_over_mean_p99']:.3f} | "
                         f"{100 * r['frac_within_target']:.1f}% | {r['capacity_q99']} | "
                         f"{r['capacity_q99_peers']} | {r['count_max']} | "
                         f"{r.get('layer_checked', 0)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv):
    del argv
    if not FLAGS.out:
        raise app.UsageError("--out is required: the folder for the JSON and markdown")
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python benchmarks/replication_bench.py " + " ".join(sys.argv[1:]),
                machine=f"{platform.machine()} CPU ({os.cpu_count()} cores)",
                num_experts=NUM_EXPERTS, top_k=TOP_K, num_layers=FLAGS.num_layers,
                num_steps=FLAGS.num_steps, warmup_steps=FLAGS.warmup_steps,
                alpha=FLAGS.alpha, num_replicated=FLAGS.num_replicated,
                rebalance_every=FLAGS.rebalance_every, oracle_every=FLAGS.oracle_every,
                fixed_tokens=FLAGS.fixed_tokens, exp_skews=[float(s) for s in FLAGS.exp_skews],
                target=FLAGS.target, seed=FLAGS.seed, layer_check=FLAGS.layer_check,
                balanced=FLAGS.balanced,
                **code_meta())
    results = []
    for p in FLAGS.ranks:
        P = int(p)
        for name, description, traces in trace_sets(P):
            print(f"{name}, EP {P}: {len(traces)} traces", flush=True)
            results.append(dict(set=name, description=description, num_ranks=P,
                                rows=run_set(traces, P)))
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, FLAGS.tag + ".json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    with open(os.path.join(FLAGS.out, FLAGS.tag + ".md"), "w") as f:
        f.write(markdown(meta, results))
    print(f"wrote {FLAGS.out}/{FLAGS.tag}.json and .md")


if __name__ == "__main__":
    app.run(main)

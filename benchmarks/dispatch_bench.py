"""Per-layer MoE dispatch latency on one multi-GPU host, against JAX's own.

    python benchmarks/dispatch_bench.py --tokens=16,64,256,1024,4096

For each tokens-per-GPU T it times, under jit over all local GPUs (expert
parallelism, one mesh axis), with routing drawn fresh every step from the
calibrated Mixtral-8x7B trace model:

  max_counts      padded lax.all_to_all at the true worst case (MaxCounts)
  cap_and_spill   C from a quantile of the trace model's per-peer counts,
                  transport lax.all_to_all ("lax") or one NCCL group ("nccl")
  ragged          lax.ragged_all_to_all (only real rows move)
  ragged:nvlink   moe_jax's count-aware NVLink kernels (only real rows move,
                  no host sync); also cap_and_spill:nvlink, and
                  ragged:nvlink_fp8 (e4m3 dispatch with per-128 scales,
                  dequantized for the experts, bf16 combine)
  gshard          GShard one-hot einsum dispatch (capacity T per expert: exact)

With --replicate=N every method runs on a hot-expert placement
(docs/design/replication.md): P x S slots, S = E/P + --spare_slots, each
pick mapped to a slot on the device as moe_layer(..., placement=) maps it
(moe_jax.replicated.balanced_slot_ids or slot_ids, inside the timed step),
then the unchanged dispatch over slots. --replica_choice=balanced (the
default) runs the balanced rule on the static Placement.spread (N > 0 only
turns replication on); --replica_choice=local runs the local rule on
moe_jax.propose of the calibrated traces' mean per-expert load, the N
hottest experts replicable. C and S of cap_and_spill and the busiest-GPU
floor then come from the slot-level rows, and every record states the
placement (header, and the method labels of the tables).

Phases: "dispatch" (pack + all-to-all), "combine" (all-to-all back + merge),
"dc" (dispatch + combine with identity experts) and "layer" (the whole
layer: dispatch, SwiGLU experts, combine, exact fallback included). It also
measures the NVLink all-to-all bandwidth and, for cap_and_spill, the cost of
the fallback guard when it is not taken. Results: JSON + markdown table in
--out, and a latency-CDF plot.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_jax as mj
from moe_jax import nvlink
from moe_jax.dispatch import DispatchContext
from moe_jax.dispatch.api import exchange_counts
from moe_jax.dispatch.cap_and_spill import cap_and_spill
from moe_jax.dispatch.passes import return_window, send_window
from moe_jax.plan import make_plan, worst_case_rows_per_peer
from moe_jax.replicated import balanced_slot_ids, slot_ids
from moe_jax.replication import PlacementArrays, choose_balanced_np, choose_replica_np
from moe_jax.traces import sample_routing

from benchmarks.provenance import code_meta, portable_command
from moe_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_list("tokens", ["16", "64", "256", "1024", "4096"], "Tokens per GPU.")
flags.DEFINE_list("quantiles", ["0.90", "0.95", "0.99", "0.995"], "Quantiles that set C.")
flags.DEFINE_list("methods", ["max_counts", "cap_and_spill:lax", "cap_and_spill:nccl",
                              "ragged", "gshard"], "Methods to time.")
flags.DEFINE_list("phases", ["dispatch", "combine", "dc", "layer"], "Phases to time.")
flags.DEFINE_integer("hidden", 4096, "Model width d.")
flags.DEFINE_integer("ffn", 14336, "Expert width (layer phase).")
flags.DEFINE_integer("experts", 8, "Experts E.")
flags.DEFINE_integer("top_k", 2, "Experts per token.")
flags.DEFINE_integer("steps", 200, "Measured steps per configuration.")
flags.DEFINE_integer("warmup", 5, "Unmeasured steps first.")
flags.DEFINE_integer("routings", 50, "Distinct routings cycled through (fresh per step).")
flags.DEFINE_integer("calibration_steps", 400, "Trace-model steps used to choose C and S.")
flags.DEFINE_integer("seed", 0, "Routing seed.")
flags.DEFINE_float("skew", mj.mixtral_8x7b_ep8().skew, "Standard deviation of the expert "
                   "log-popularity drawn afresh every step (default: the calibrated "
                   "Mixtral-8x7B value; 0: uniform).")
flags.DEFINE_string("out", None, "Folder for JSON, markdown and plot. Required: the records under docs/benchmarks/ are only written when named.")
flags.DEFINE_string("tag", "dispatch", "File name stem of the results.")
flags.DEFINE_float("time_budget_s", 480, "Stop starting new configurations after this.")
flags.DEFINE_enum("timing", "host", ["host", "loop"],
                  "host: time each step around a synchronous call (percentiles); loop: run "
                  "all steps inside one jitted fori_loop and report the mean per step "
                  "(device-side latency, no host dispatch between steps).")
flags.DEFINE_enum("consume", "sum", ["sum", "first_row"],
                  "With --timing=loop, what each step adds to the loop's result: the float32 "
                  "sum of its whole output (sum: reads every delivered row, the padded receive "
                  "buffer of a dispatch included) or of its first row only (first_row: the "
                  "step's kernels all run, but no read of the output is timed; comparable to "
                  "published kernel-only dispatch latencies).")
flags.DEFINE_integer("replicate", 0, "Hot-expert replication: 0 off; N > 0 runs every "
                     "method on a placement (module docstring): with --replica_choice=local "
                     "the N hottest experts of the calibrated traces' mean load are "
                     "replicable (moe_jax.propose); with balanced, Placement.spread.")
flags.DEFINE_enum("replica_choice", "balanced", ["local", "balanced"],
                  "With --replicate: 'balanced' (the step's per-expert counts, all-gathered, "
                  "level the replicas of the static Placement.spread; what "
                  "docs/design/replication.md recommends) or 'local' (the sender's own "
                  "replica, else a hash of the token; placement from moe_jax.propose).")
flags.DEFINE_integer("spare_slots", 1, "With --replicate: extra expert slots per rank "
                     "(S = experts / ranks + spare_slots).")
flags.DEFINE_integer("loop_unroll", 1, "With --timing=loop: steps per loop iteration "
                     "(amortizes the loop's own per-iteration cost).")


def _mesh():
    devices = jax.devices()
    return jax.make_mesh((len(devices),), ("ep",), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,))


def _routing_batches(ranks, tokens, num, seed):
    rng = np.random.default_rng(seed)
    ids, weights = [], []
    for _ in range(num):
        e, g = sample_routing(rng, ranks * tokens, FLAGS.experts, FLAGS.top_k, FLAGS.skew)
        ids.append(e.astype(np.int32))
        weights.append(g.astype(np.float32))
    return np.stack(ids), np.stack(weights)


def _placement(ranks):
    """The run's Placement under --replicate (None when it is off)."""
    if not FLAGS.replicate:
        return None
    slots = FLAGS.experts // ranks + FLAGS.spare_slots
    if FLAGS.replica_choice == "balanced":
        return mj.Placement.spread(FLAGS.experts, ranks, slots)
    traces = mj.generate_traces(num_experts=FLAGS.experts, num_ranks=ranks, top_k=FLAGS.top_k,
                                num_layers=1, num_steps=FLAGS.calibration_steps,
                                skew=FLAGS.skew, seed=FLAGS.seed + 2)
    loads = np.mean([np.bincount(t.experts.reshape(-1), minlength=FLAGS.experts)
                     for t in traces], axis=0)
    return mj.propose(loads, ranks, slots, FLAGS.replicate)


def _dest_ranks(ids, ranks, placement):
    """[N, k] destination rank of each pick of one step's routing (the ranks'
    tokens in equal contiguous shards): the expert's home rank, or with a
    placement the rank of the slot moe_jax.replication's NumPy rule names
    (the layer's token index r * T + t for the local rule's hash)."""
    if placement is None:
        return ids // (FLAGS.experts // ranks)
    arrays, slots = placement.as_arrays(), placement.slot_expert.shape[1]
    if FLAGS.replica_choice == "balanced":
        slot = choose_balanced_np(ids.reshape(ranks, -1), None, None, arrays["replica_slots"],
                                  arrays["num_replicas"], slots).reshape(ids.shape)
    else:
        token = np.arange(ids.shape[0])[:, None]
        slot = choose_replica_np(token, ids, token // (ids.shape[0] // ranks),
                                 arrays["local_slot"], arrays["replica_slots"],
                                 arrays["num_replicas"])
    return slot // slots


def _peer_counts(ids, ranks, placement):
    """[P, P] (token, pick) rows per (source, destination rank) of one step."""
    source = np.repeat(np.arange(ranks), ids.shape[0] // ranks)[:, None]
    pair = source * ranks + _dest_ranks(ids, ranks, placement)
    return np.bincount(pair.reshape(-1), minlength=ranks * ranks).reshape(ranks, ranks)


_SLOT_COUNTS = {}   # (ranks, tokens, placement bytes) -> [steps, P, P] calibration counts


def _calibrate(ranks, tokens, quantile, placement=None):
    key = None if placement is None else (ranks, tokens, placement.slot_expert.tobytes())
    if key not in _SLOT_COUNTS:
        traces = mj.generate_traces(num_experts=FLAGS.experts, num_ranks=ranks,
                                    top_k=FLAGS.top_k, num_layers=1,
                                    num_steps=FLAGS.calibration_steps, tokens_per_rank=tokens,
                                    skew=FLAGS.skew, seed=FLAGS.seed + 1)
        if placement is None:
            return mj.calibrate(traces, quantile, num_ranks=ranks, num_experts=FLAGS.experts)
        _SLOT_COUNTS[key] = np.stack([_peer_counts(t.experts, ranks, placement)
                                      for t in traces])
    return mj.calibrate(_SLOT_COUNTS[key], quantile, num_ranks=ranks)


def _context(mesh, ranks, transport="lax"):
    backend = "cpu" if mesh.devices.flat[0].platform == "cpu" else "gpu"
    return DispatchContext("ep", ranks, transport, "custom_call", backend,
                           tuple(mesh.devices.flat))


def _to_slots(ids, placement, ctx):
    """With placement arrays: each pick's global slot, as moe_layer maps it."""
    if placement is None:
        return ids
    if FLAGS.replica_choice == "balanced":
        return balanced_slot_ids(ids, placement, ctx.rank(), ctx.all_gather)
    rank = ctx.rank()
    return slot_ids(ids, placement, rank, rank * ids.shape[0])


def _delivered_rows(mesh, ranks, inputs, placement):
    """[routings, P] rows each rank's experts (slots) receive, by the layer's
    own slot mapping and the ragged dispatch on the devices."""
    ctx = _context(mesh, ranks)
    per_rank = placement.slot_expert.shape[1] if placement is not None else FLAGS.experts // ranks
    arrays = tuple(placement.device_arrays()) if placement is not None else ()

    def body(x, ids, w, *parr):
        slot = _to_slots(ids, PlacementArrays(*parr) if parr else None, ctx)
        res = mj.dispatch_combine(x, slot, w, _identity, strategy="ragged", ctx=ctx,
                                  experts_per_rank=per_rank, return_delivered=True)
        return res.delivered.group_sizes

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3 + (P(),) * len(arrays),
                               out_specs=P("ep"), check_vma=False))
    return np.stack([np.asarray(fn(*args, *arrays)).reshape(ranks, per_rank).sum(1)
                     for args in inputs])


def _identity(rows, group_sizes):
    return rows


def _swiglu(experts):
    return lambda rows, sizes: mj.swiglu_grouped(rows, sizes, experts, jnp.bfloat16)


def _gshard(x, ids, w, expert_fn, ctx, experts_per_rank, phase):
    """GShard einsum dispatch with capacity T per expert (no token dropped)."""
    tokens, _ = x.shape
    num_experts = ctx.num_ranks * experts_per_rank
    onehot = jax.nn.one_hot(ids, num_experts, dtype=jnp.int32)          # [T, k, E]
    slot = jnp.cumsum(onehot.sum(1), axis=0) - onehot.sum(1)            # [T, E] position
    mask = onehot.sum(1).astype(x.dtype)                                # [T, E]
    position = jax.nn.one_hot(slot, tokens, dtype=x.dtype) * mask[..., None]   # [T, E, C=T]
    combine_w = (onehot * w[..., None]).sum(1)                          # [T, E]
    send = jnp.einsum("tec,td->ecd", position, x)                      # [E, T, d]
    send = send.reshape(ctx.num_ranks, experts_per_rank, tokens, -1)
    recv = jax.lax.all_to_all(send, "ep", 0, 0, tiled=False)           # [P(src), El, T, d]
    if phase == "dispatch":
        return recv
    rows = jnp.swapaxes(recv, 0, 1).reshape(experts_per_rank, -1, x.shape[1])
    sizes = jnp.full((experts_per_rank,), rows.shape[1], jnp.int32)
    out = expert_fn(rows.reshape(-1, x.shape[1]), sizes).reshape(rows.shape)
    back = jnp.swapaxes(out.reshape(experts_per_rank, ctx.num_ranks, tokens, -1), 0, 1)
    back = jax.lax.all_to_all(back, "ep", 0, 0, tiled=False).reshape(num_experts, tokens, -1)
    return jnp.einsum("tec,ecd->td", position * combine_w[..., None], back)


def _build(method, phase, ranks, tokens, capacity, spill, experts, mesh, placement=None):
    """A jitted function (x, ids, w, *extra) -> output for one method and phase;
    extra: the expert weights (layer phase), then the placement's arrays
    (with --replicate)."""
    strategy, _, transport = method.partition(":")
    noguard = transport == "noguard"
    fp8 = transport == "nvlink_fp8"
    transport = {"nccl": "custom_call", "": "lax", "lax": "lax", "noguard": "lax",
                 "nvlink": "nvlink", "nvlink_fp8": "nvlink"}[transport]
    experts_per_rank = (placement.slot_expert.shape[1] if placement is not None
                        else FLAGS.experts // ranks)
    ctx = _context(mesh, ranks, transport)
    num_weights = len(experts) if phase == "layer" else 0
    worst = worst_case_rows_per_peer(tokens, FLAGS.top_k, experts_per_rank)
    expert_fn = _swiglu(experts) if phase == "layer" else _identity

    def body(x, ids, w, *extra):
        nonlocal expert_fn
        if phase == "layer":
            expert_fn = _swiglu(mj.ExpertWeights(*extra[:num_weights]))
        if placement is not None:
            ids = _to_slots(ids, PlacementArrays(*extra[num_weights:]), ctx)
        if strategy == "gshard":
            return _gshard(x, ids, w, expert_fn, ctx, experts_per_rank, phase)
        if transport == "nvlink" and (phase == "dispatch" or fp8):
            channel, got = nvlink.dispatch(x, ids, experts_per_rank=experts_per_rank,
                                           axis_name="ep", mesh_devices=ctx.mesh_devices,
                                           fp8=fp8)
            if phase == "dispatch":
                return got.rows
            rows = nvlink.dequantize(got.rows, got.scales, x.dtype) if fp8 else got.rows
            return nvlink.combine(channel, expert_fn(rows, got.group_sizes).astype(x.dtype),
                                  got, ids, w, axis_name="ep")
        if phase in ("dispatch", "combine") and strategy in ("max_counts", "cap_and_spill"):
            plan = make_plan(ids, ranks, experts_per_rank)
            cap, sp = (worst, 0) if strategy == "max_counts" else (capacity, spill)
            if phase == "dispatch":
                return send_window(x, plan, ctx, start=0, capacity=cap, spill_capacity=sp)
            rows = jnp.broadcast_to(x[:1], (ranks, cap + sp, x.shape[1]))
            return return_window(rows, w, plan, ctx, start=0)
        kw = dict(capacity=capacity, spill_capacity=spill)
        if noguard:
            plan = make_plan(ids, ranks, experts_per_rank)
            counts, peers = exchange_counts(plan, ctx)
            return cap_and_spill(x, w, plan, ctx, expert_fn, recv_expert_counts=counts,
                                 peer_counts=peers, _measure_without_fallback=True, **kw)[0]
        return mj.dispatch_combine(x, ids, w, expert_fn, strategy=strategy, ctx=ctx,
                                   experts_per_rank=experts_per_rank, **kw).out

    specs = (P("ep"),) * (3 + num_weights) + ((P(),) * 4 if placement is not None else ())
    if FLAGS.timing == "loop":
        def looped(x, ids_steps, w_steps, *extra):
            def step(i, acc):
                out = body(x, ids_steps[i], w_steps[i], *extra)
                if FLAGS.consume == "first_row":
                    out = out.reshape(-1, out.shape[-1])[:1]
                return acc + jnp.sum(out.astype(jnp.float32))
            return jax.lax.fori_loop(0, ids_steps.shape[0], step, jnp.zeros((), jnp.float32),
                                     unroll=FLAGS.loop_unroll)
        loop_specs = (P("ep"), P(None, "ep"), P(None, "ep")) + specs[3:]
        return jax.jit(jax.shard_map(looped, mesh=mesh, in_specs=loop_specs, out_specs=P(),
                                     check_vma=False))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("ep"),
                                 check_vma=False))


def _time_loop(fn, x, ids_steps, w_steps, extra):
    """Mean per-step latency of FLAGS.steps steps run inside one program."""
    jax.block_until_ready(fn(x, ids_steps, w_steps, *extra))
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x, ids_steps, w_steps, *extra))
        runs.append((time.perf_counter() - t0) * 1e6 / ids_steps.shape[0])
    best = float(np.median(runs))
    return dict(mean_us=best, median_us=best, p95_us=max(runs), p99_us=max(runs),
                pipelined_mean_us=best, samples_us=[round(v, 1) for v in runs])


def _time(fn, inputs, extra):
    """Per-step latencies (synchronous) and the pipelined mean, in microseconds."""
    for i in range(FLAGS.warmup):
        jax.block_until_ready(fn(*inputs[i % len(inputs)], *extra))
    lat = []
    for i in range(FLAGS.steps):
        args = inputs[i % len(inputs)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args, *extra))
        lat.append((time.perf_counter() - t0) * 1e6)
    t0 = time.perf_counter()
    outs = [fn(*inputs[i % len(inputs)], *extra) for i in range(FLAGS.steps)]
    jax.block_until_ready(outs)
    pipelined = (time.perf_counter() - t0) * 1e6 / FLAGS.steps
    lat = np.asarray(lat)
    return dict(mean_us=float(lat.mean()), median_us=float(np.median(lat)),
                p95_us=float(np.percentile(lat, 95)), p99_us=float(np.percentile(lat, 99)),
                pipelined_mean_us=float(pipelined), samples_us=[round(v, 1) for v in lat])


def _busiest_gpu_rows(counts):
    """Mean over routings of the most remote rows one GPU sends or receives.

    counts: [routings, source, destination] (token, pick) rows. Dispatch
    sends source -> destination and combine returns them, so the busier
    direction of the busiest GPU bounds both halves.
    """
    remote = counts * (1 - np.eye(counts.shape[1], dtype=counts.dtype))
    return float(np.mean(np.maximum(remote.sum(2), remote.sum(1)).max(1)))


def _alltoall_bandwidth(mesh, ranks):
    """Bytes each GPU sends to the others per second in a large all-to-all."""
    rows = 8192
    x = jax.device_put(jnp.ones((ranks * ranks, rows, FLAGS.hidden), jnp.bfloat16),
                       NamedSharding(mesh, P("ep")))
    fn = jax.jit(jax.shard_map(lambda a: jax.lax.all_to_all(a, "ep", 0, 0, tiled=False),
                               mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    jax.block_until_ready(fn(x))
    t0 = time.perf_counter()
    reps = 20
    for _ in range(reps):
        x = fn(x)
    jax.block_until_ready(x)
    seconds = (time.perf_counter() - t0) / reps
    sent = (ranks - 1) * rows * FLAGS.hidden * 2
    return sent / seconds


def main(argv):
    del argv
    if not FLAGS.out:
        raise app.UsageError("--out is required (the folder for the results)")
    if FLAGS.skew < 0:
        raise app.UsageError(f"--skew={FLAGS.skew} must be >= 0")
    if FLAGS.replicate < 0:
        raise app.UsageError(f"--replicate={FLAGS.replicate} must be >= 0")
    if FLAGS.replicate and FLAGS.spare_slots < 1:
        raise app.UsageError(f"--spare_slots={FLAGS.spare_slots} must be >= 1")
    start_time = time.time()
    mesh = _mesh()
    ranks = mesh.shape["ep"]
    if FLAGS.replicate and FLAGS.experts % ranks:
        raise app.UsageError(f"--experts={FLAGS.experts} must be a multiple of the "
                             f"{ranks} devices with --replicate")
    placement = _placement(ranks)
    placement_arrays = tuple(placement.device_arrays()) if placement is not None else ()
    experts_per_rank = (placement.slot_expert.shape[1] if placement is not None
                        else FLAGS.experts // ranks)
    if placement is not None:
        print(f"replication: {_placement_text(placement)}", flush=True)
    devices = jax.devices()
    sharding = NamedSharding(mesh, P("ep"))
    bandwidth = _alltoall_bandwidth(mesh, ranks) if ranks > 1 else None  # None: no peers
    print(f"{ranks} x {devices[0].device_kind}; all-to-all "
          + (f"{bandwidth / 1e9:.1f} GB/s per GPU" if bandwidth else "(one device, no peers)"),
          flush=True)
    experts = None
    if "layer" in FLAGS.phases:
        ew = mj.init_expert_weights(jax.random.key(0), FLAGS.experts, FLAGS.hidden, FLAGS.ffn,
                                    jnp.bfloat16)
        if placement is not None:
            ew = mj.slot_weights(ew, placement)
        experts = tuple(jax.device_put(a, sharding) for a in ew)
    results = []
    stopped = False
    for tokens in map(int, FLAGS.tokens):
        ids, weights = _routing_batches(ranks, tokens, FLAGS.routings, FLAGS.seed)
        x = jax.device_put(jax.random.normal(jax.random.key(1), (ranks * tokens, FLAGS.hidden),
                                             jnp.bfloat16), sharding)
        inputs = [(x, jax.device_put(i, sharding), jax.device_put(w, sharding))
                  for i, w in zip(ids, weights)]
        steps_sharding = NamedSharding(mesh, P(None, "ep"))
        reps = -(-FLAGS.steps // len(ids))
        stacked = (jax.device_put(np.concatenate([ids] * reps)[:FLAGS.steps], steps_sharding),
                   jax.device_put(np.concatenate([weights] * reps)[:FLAGS.steps],
                                  steps_sharding))
        worst = worst_case_rows_per_peer(tokens, FLAGS.top_k, experts_per_rank)
        counts = np.concatenate([_peer_counts(i, ranks, placement) for i in ids])
        delivered = _delivered_rows(mesh, ranks, inputs, placement)
        if not (delivered == counts.reshape(len(ids), ranks, ranks).sum(1)).all():
            raise RuntimeError(f"T={tokens}: the rows the devices delivered per rank differ "
                               "from moe_jax.replication's NumPy rule")
        rows_per_rank = [float(v) for v in delivered.mean(0)]
        busiest_rank_rows = float(delivered.max(1).mean())
        actual_rows = float(np.mean(counts.sum(1) - counts[np.arange(len(counts)),
                                                             np.arange(len(counts)) % ranks]))
        busiest_rows = _busiest_gpu_rows(counts.reshape(len(ids), ranks, ranks))
        floor_us, busiest_floor_us = (
            (rows * FLAGS.hidden * 2 / bandwidth * 1e6 * 2 if bandwidth else None)
            for rows in (actual_rows, busiest_rows))
        configs = []
        for method in FLAGS.methods:
            if method == "cap_and_spill:nvlink":  # C does not change what moves
                configs.append((method, 0.99, _calibrate(ranks, tokens, 0.99, placement)))
            elif method.startswith("cap_and_spill"):
                for q in map(float, FLAGS.quantiles):
                    calib = _calibrate(ranks, tokens, q, placement)
                    configs.append((method, q, calib))
                if method == "cap_and_spill:lax":
                    configs.append(("cap_and_spill:noguard", 0.99,
                                    _calibrate(ranks, tokens, 0.99, placement)))
            else:
                configs.append((method, None, None))
        for method, q, calib in configs:
            for phase in FLAGS.phases:
                if time.time() - start_time > FLAGS.time_budget_s:
                    print("time budget reached; stopping", flush=True)
                    stopped = True
                    break
                if method.startswith("cap_and_spill") and phase in ("dispatch", "combine") \
                        and (q != 0.99 or method == "cap_and_spill:noguard"):
                    continue  # the halves at one quantile; every quantile as dc and layer
                if (method == "ragged" and phase in ("dispatch", "combine")) or (
                        method in ("gshard", "ragged:nvlink", "ragged:nvlink_fp8", "cap_and_spill:nvlink")
                        and phase == "combine"):
                    continue
                cap = calib.capacity if calib else None
                spill = calib.spill_capacity if calib else None
                try:
                    fn = _build(method, phase, ranks, tokens, cap, spill,
                                experts, mesh, placement)
                    extra = (experts if phase == "layer" else ()) + placement_arrays
                    if FLAGS.timing == "loop":
                        timing = _time_loop(fn, x, *stacked, extra)
                    else:
                        timing = _time(fn, inputs, extra)
                except Exception as err:  # recorded, not fatal: one method may not run
                    print(f"T={tokens} {method} {phase}: FAILED {type(err).__name__}: "
                          f"{str(err)[:300]}", flush=True)
                    results.append(dict(tokens=tokens, method=method, phase=phase,
                                        quantile=q, placement=_placement_label(placement),
                                        error=f"{type(err).__name__}: {err}"[:2000]))
                    continue
                row = dict(tokens=tokens, method=method, phase=phase, quantile=q,
                           capacity=cap, spill_capacity=spill, worst_case=worst,
                           overflow_rate=None if calib is None else
                           calib.frac_counts_over_capacity,
                           fallback_rate=None if calib is None else calib.frac_counts_over_total,
                           byte_floor_dc_us=floor_us,
                           busiest_floor_dc_us=busiest_floor_us,
                           placement=_placement_label(placement),
                           rows_per_rank=rows_per_rank, busiest_rank_rows=busiest_rank_rows,
                           **timing)
                results.append(row)
                print(f"T={tokens:5d} {method:22s} q={q} {phase:8s} mean {timing['mean_us']:9.1f}"
                      f" median {timing['median_us']:9.1f} p99 {timing['p99_us']:9.1f} "
                      f"pipelined {timing['pipelined_mean_us']:9.1f} us", flush=True)
        _write(results, devices, bandwidth, placement, partial=True)
    _write(results, devices, bandwidth, placement, partial=stopped)


def _placement_label(placement):
    """Short tag of the run's replication for every result row (None: off)."""
    if placement is None:
        return None
    return f"{FLAGS.replica_choice} S={placement.slot_expert.shape[1]}"


def _placement_text(placement):
    rule = ("balanced rule on Placement.spread" if FLAGS.replica_choice == "balanced" else
            f"local rule on moe_jax.propose of the calibrated traces' mean load, "
            f"{FLAGS.replicate} hottest experts replicable")
    return (f"{rule}, S={placement.slot_expert.shape[1]} slots per rank, slot_expert "
            f"{placement.slot_expert.tolist()}")


def _write(results, devices, bandwidth, placement, partial):
    os.makedirs(FLAGS.out, exist_ok=True)
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=portable_command("python " + " ".join(sys.argv)), host=socket.gethostname(),
        devices=f"{len(devices)} x {devices[0].device_kind}", jax=jax.__version__,
        jaxlib=jax.lib.__version__ if hasattr(jax.lib, "__version__") else "",
        moe_jax=mj.__version__, **code_meta(), python=platform.python_version(),
        alltoall_bandwidth_GBps_per_gpu=bandwidth / 1e9 if bandwidth else None,
        hidden=FLAGS.hidden,
        timing=FLAGS.timing, loop_unroll=FLAGS.loop_unroll, consume=FLAGS.consume,
        experts=FLAGS.experts, top_k=FLAGS.top_k, skew=FLAGS.skew, steps=FLAGS.steps,
        partial=partial,
        replication=None if placement is None else dict(
            replica_choice=FLAGS.replica_choice, replicate=FLAGS.replicate,
            spare_slots=FLAGS.spare_slots, slots_per_rank=placement.slot_expert.shape[1],
            slot_expert=placement.slot_expert.tolist(), text=_placement_text(placement)),
        xla_flags=os.environ.get("XLA_FLAGS", ""))
    stem = os.path.join(FLAGS.out, FLAGS.tag)
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    from benchmarks.report import write_report  # noqa: PLC0415
    write_report(stem + ".json")


if __name__ == "__main__":
    cli.run(main)

"""Greedy generation with a small Mixtral-style MoE decoder, on CPU devices or GPUs.

    python examples/generate.py [--strategy=cap_and_spill] [--transport=lax] [--ep=8]
        [--data_parallel=2]
        [--tokens=24] [--variant=linen|nnx] [--record_traces=routing.jsonl]
        [--calibrate_from=routing.jsonl] [--checkpoint_dir=CKPT_DIR]
        [--benchmark_steps=20 [--benchmark_methods=dense,ragged,cap_and_spill:custom_call]
         [--benchmark_out=bench.json]] [--tokens_out=tokens.json]
        [--replicate_hot_experts=3 [--spare_slots=1]]

Builds the decoder (random weights, or restored from --checkpoint_dir; a
directory without a checkpoint gets one written), generates --tokens tokens
for a batch of random left-padded prompts in one jitted program (prefill,
then a scan over decode steps with a fixed-length KV cache), and prints the
tokens, the dispatch counters and the time. For cap_and_spill, C and S come
from --capacity/--spill_capacity, else from the trace in --calibrate_from,
else from a trace recorded by a first (ragged) run of the same prompts.
With --data_parallel=D the mesh is ("data", "ep") of D x --ep devices: D
data-parallel groups, each its own expert-parallel group (MoEConfig
.data_axes); C and S are calibrated per group (each group's dispatch is one
observation).
Every strategy, transport, --ep and --data_parallel size generates the same
tokens: the
router and the experts multiply with moe_jax.row_invariant (--matmul), whose
rows do not change bits with the number of rows in a call. With
--matmul=xla (XLA's dots; on GPU their rounding depends on the row count)
tokens can differ where two logits nearly tie.

With --replicate_hot_experts=N the run is repeated with hot-expert
replication: each layer's per-expert load (an EMA, moe_jax.replication
.LoadTracker, over the routing of the first run) chooses a placement of up to
N replicated experts on --spare_slots extra slots per rank (moe_jax
.replication.propose), the expert weights are copied onto the slots, and the
replicated run must generate the same tokens; it prints each layer's
placement and the busiest rank's expected rows over the mean's before and
after. --replica_choice=balanced instead runs every layer on the static
Placement.spread with the balanced rule (each step's counts level the
replicas).

With --benchmark_steps=N it instead times the compiled generation of every
method in --benchmark_methods (compilation and --benchmark_warmup runs
excluded, then N timed runs), checks that they all generate the same
tokens, and prints a table of tokens/s and per-token latency (mean, p50,
p99); --benchmark_out writes it as JSON.

Devices: JAX_PLATFORMS picks the platform (default here: cpu, with 8 CPU
devices unless XLA_FLAGS says otherwise); on GPUs run with
JAX_PLATFORMS=cuda. Progress bars use tqdm when it is installed.

Multi-process (jax.distributed): start one copy per process with
--coordinator=HOST:PORT --num_processes=N --process_id=I (on a GPU host also
--local_device_ids=I for one GPU per process), or let examples/launch.py
start them. The mesh spans every process's devices; each process builds the
same inputs and gets the whole result; process 0 prints and writes the
files. On CPU the processes talk through gloo, and moe_jax's CPU all-to-all
custom call (an in-process rendezvous) cannot cross processes: use
--transport=lax there; the ragged strategy then runs its all-to-all as the
pure-JAX reference (--kernel_impl=auto picks it).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from flax import nnx  # noqa: E402

import moe_jax as mj  # noqa: E402
from moe_jax import checkpoint, cli  # noqa: E402
from moe_jax.config import STRATEGIES, TRANSPORTS  # noqa: E402
from moe_jax.models.flags import define_model_flags  # noqa: E402
from moe_jax.models import (DecoderConfig, MixtralLinen, MixtralNnx, init_params,  # noqa: E402
                            nnx_load_params)
from moe_jax.models.benchmark import format_table, time_generation  # noqa: E402
from moe_jax.models.distributed import initialize  # noqa: E402
from moe_jax.models.generate import (check_multiprocess, generate, pad_prompts,  # noqa: E402
                                     prepare_generation)
from moe_jax.models.decoder import replicate_params  # noqa: E402
from moe_jax.models.sharding import spans_processes  # noqa: E402
from moe_jax.replication import expected_rank_loads  # noqa: E402
from moe_jax.models.progress import Progress  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("strategy", "cap_and_spill", list(STRATEGIES), "MoE dispatch strategy.")
flags.DEFINE_enum("transport", "lax", list(TRANSPORTS),
                  "How buffers cross ranks (nvlink: the GPUs of one host, strategies ragged "
                  "and cap_and_spill).")
flags.DEFINE_enum("kernel_impl", "auto", ["auto", "custom_call", "reference"],
                  "Pack/combine as custom calls or their pure-JAX references (auto: "
                  "custom_call, except for the ragged strategy on a multi-process CPU mesh).")
flags.DEFINE_enum("matmul", "row_invariant", ["row_invariant", "auto", "cutlass", "xla"],
                  "Router and expert matmuls (MoEConfig.matmul): row_invariant gives every "
                  "strategy and EP size the same bits; auto / cutlass use the CUTLASS "
                  "grouped GEMMs on Hopper GPUs; xla uses XLA's dots.")
flags.DEFINE_integer("ep", None, "Expert-parallel ranks (devices on the mesh axis 'ep'; "
                     "default: all devices).")
flags.DEFINE_integer("data_parallel", 1, "Data-parallel groups D: the mesh becomes "
                     "('data', 'ep') with D x --ep devices and the MoE layers split their "
                     "tokens over both axes.")
flags.DEFINE_integer("tokens", 24, "New tokens to generate per sequence.")
flags.DEFINE_integer("batch", 8, "Prompts in the batch (a multiple of --ep x "
                     "--data_parallel).")
flags.DEFINE_integer("prompt_len", 8, "Longest prompt; prompts get 1..prompt_len tokens.")
flags.DEFINE_enum("variant", "linen", ["linen", "nnx"], "Flax API of the model.")
flags.DEFINE_string("record_traces", None, "Write the routing of every layer and step "
                    "to this JSONL file (moe_jax.traces format).")
flags.DEFINE_string("calibrate_from", None, "Choose C and S from the routing traces in "
                    "this JSONL file (cap_and_spill).")
flags.DEFINE_float("quantile", 0.99, "Quantile of the per-peer counts that sets C.")
flags.DEFINE_integer("capacity", None, "C for cap_and_spill (overrides calibration).")
flags.DEFINE_integer("spill_capacity", None, "S for cap_and_spill (overrides calibration).")
flags.DEFINE_string("checkpoint_dir", None, "Restore the parameters from this directory, "
                    "or save them there if it holds no checkpoint.")
flags.DEFINE_string("tokens_out", None, "Write the generated tokens (and the run's "
                    "settings) to this JSON file (written by process 0; with '{process}' in "
                    "the path, by every process, named by its index).")
flags.DEFINE_integer("benchmark_steps", 0, "If > 0: time this many runs of the compiled "
                     "generation for every method of --benchmark_methods.")
flags.DEFINE_integer("benchmark_warmup", 2, "Untimed runs before the timed ones.")
flags.DEFINE_list("benchmark_methods", ["dense", "max_counts", "cap_and_spill", "ragged"],
                  "Methods to benchmark: STRATEGY or STRATEGY:TRANSPORT (default transport: "
                  "--transport).")
flags.DEFINE_string("benchmark_out", None, "Write the benchmark results to this JSON file.")
flags.DEFINE_integer("seed", 0, "Seed of the weights and prompts.")
flags.DEFINE_integer("replicate_hot_experts", 0, "If > 0: also generate with up to this many "
                     "hot experts per layer replicated (placement from the first run's "
                     "routing) and check the tokens are the same.")
flags.DEFINE_integer("spare_slots", 1, "Extra expert slots per rank for "
                     "--replicate_hot_experts (S = experts / ep + spare_slots).")
flags.DEFINE_enum("replica_choice", "local", ["local", "balanced"],
                  "With --replicate_hot_experts: 'local' (the sender's replica, else a hash "
                  "of the token; placements from the routing) or 'balanced' (each step's "
                  "counts level the replicas of the static Placement.spread).")
define_model_flags()
flags.DEFINE_string("coordinator", None, "HOST:PORT of process 0: run as one process of a "
                    "jax.distributed run (with --num_processes and --process_id).")
flags.DEFINE_integer("num_processes", 1, "Processes of the jax.distributed run.")
flags.DEFINE_integer("process_id", 0, "This process's index in [0, --num_processes).")
flags.DEFINE_list("local_device_ids", None, "GPUs of this process (e.g. its process id for "
                  "one GPU per process; default: every visible one).")
flags.DEFINE_enum("progress", "auto", ["auto", "on", "off"],
                  "Progress bars (auto: on a terminal, for >= 64 decode steps or >= 20 timed "
                  "runs).")


def say(*args) -> None:
    """Prints on process 0 only."""
    if jax.process_index() == 0:
        print(*args, flush=True)


def data_axes() -> tuple[str, ...]:
    return ("data",) if FLAGS.data_parallel > 1 else ()


def build_config(**changes) -> DecoderConfig:
    return DecoderConfig.create(vocab_size=FLAGS.vocab, d_model=FLAGS.d_model,
                                num_heads=FLAGS.heads, num_layers=FLAGS.layers,
                                num_experts=FLAGS.experts, top_k=FLAGS.top_k,
                                ffn_size=FLAGS.ffn, max_len=FLAGS.prompt_len + FLAGS.tokens,
                                matmul=FLAGS.matmul, data_axes=data_axes(), **changes)


def show_progress(units: int, long: int) -> bool:
    if FLAGS.progress == "off" or units < 1 or jax.process_index() != 0:
        return False
    return FLAGS.progress == "on" or (sys.stderr.isatty() and units >= long)


def make_model(cfg, mesh, params, placements=None):
    """(model, params argument of generate) for the chosen Flax variant."""
    choice = FLAGS.replica_choice if placements is not None else "local"
    if FLAGS.variant == "nnx":
        model = MixtralNnx(cfg, mesh=mesh, rngs=nnx.Rngs(0), placements=placements,
                           replica_choice=choice)
        return nnx_load_params(model, params), None
    return MixtralLinen(cfg, mesh, choice), params


def run(cfg, mesh, params, prompts, record=False, label="generate", placements=None):
    """Generates with the chosen Flax variant; returns (result, seconds).
    placements: one per layer (params then hold slot weights)."""
    model, args = make_model(cfg, mesh, params, placements)
    steps = FLAGS.tokens - 1
    progress = Progress(steps, label) if show_progress(steps, 64) else None
    start = time.perf_counter()
    result = generate(model, args, *prompts, max_new_tokens=FLAGS.tokens, mesh=mesh,
                      record_traces=record, on_step=progress,
                      placements=placements if FLAGS.variant == "linen" else None)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return result, seconds


def parse_method(method: str) -> tuple[str, str]:
    """'strategy' or 'strategy:transport' -> (strategy, transport)."""
    strategy, _, transport = method.partition(":")
    transport = transport or FLAGS.transport
    if strategy not in STRATEGIES:
        raise app.UsageError(f"--benchmark_methods: unknown strategy {strategy!r} in "
                             f"{method!r} (one of {STRATEGIES})")
    if transport not in TRANSPORTS:
        raise app.UsageError(f"--benchmark_methods: unknown transport {transport!r} in "
                             f"{method!r} (one of {TRANSPORTS})")
    return strategy, transport


def kernel_impl(strategy: str, mesh) -> str:
    """--kernel_impl, with "auto" resolved for `strategy` on `mesh`."""
    if FLAGS.kernel_impl != "auto":
        return FLAGS.kernel_impl
    cpu = mesh.devices.flat[0].platform == "cpu"
    # The ragged strategy's CPU all-to-all is a custom call unless the
    # reference runs; the custom call cannot cross processes.
    return "reference" if strategy == "ragged" and cpu and spans_processes(mesh) \
        else "custom_call"


def method_config(base: DecoderConfig, strategy: str, transport: str, capacities, mesh):
    """The config of one (strategy, transport), with C and S for cap_and_spill."""
    if transport == "nvlink" and strategy == "max_counts":
        raise app.UsageError(f"transport 'nvlink' runs strategies ragged and cap_and_spill, "
                             f"not {strategy!r}")
    changes = dict(strategy=strategy, transport=transport,
                   kernel_impl=kernel_impl(strategy, mesh))
    if strategy == "cap_and_spill":
        changes.update(capacity=capacities[0], spill_capacity=capacities[1])
    cfg = base.replace(**changes)
    try:
        check_multiprocess(cfg, mesh)
    except ValueError as e:
        raise app.UsageError(f"{strategy}:{transport} on {jax.process_count()} processes: "
                             f"{e}") from None
    return cfg


def capacities(base, mesh, params, prompts, ep: int):
    """(C, S, calibration report or None) for cap_and_spill."""
    calib, source = None, None
    if FLAGS.calibrate_from:
        # Counted for `ep` ranks, whatever EP size the traces were recorded at.
        traces = mj.load_jsonl(FLAGS.calibrate_from)
        try:
            calib = mj.calibrate(traces, FLAGS.quantile, num_ranks=ep,
                                 num_groups=FLAGS.data_parallel)
        except ValueError as e:
            raise app.UsageError(f"--calibrate_from={FLAGS.calibrate_from}: {e}") from None
        groups = f"{FLAGS.data_parallel} groups of " if FLAGS.data_parallel > 1 else ""
        source = (f"{len(traces)} traces in {FLAGS.calibrate_from} (recorded at "
                  f"{traces[0].num_ranks} ranks, counted for {groups}{ep})")
    elif FLAGS.capacity is None or FLAGS.spill_capacity is None:
        cfg = method_config(base, "ragged", FLAGS.transport, None, mesh)
        result, _ = run(cfg, mesh, params, prompts, record=True, label="calibration run")
        calib = mj.calibrate(result.traces, FLAGS.quantile, num_groups=FLAGS.data_parallel)
        source = f"{len(result.traces)} traces of a ragged calibration run"
    capacity = FLAGS.capacity if FLAGS.capacity is not None else calib.capacity
    spill = FLAGS.spill_capacity if FLAGS.spill_capacity is not None else calib.spill_capacity
    report = None
    if calib is not None:
        say(f"calibrated at q={FLAGS.quantile} from {source}: C={calib.capacity} "
            f"S={calib.spill_capacity} (per-peer counts: mean {calib.count_mean:.1f}, "
            f"max {calib.count_max}; {calib.frac_steps_spill:.1%} of dispatches spill, "
            f"{calib.frac_steps_fallback:.1%} need the fallback)")
        report = dict(source=source, calibrate_from=FLAGS.calibrate_from,
                      quantile=FLAGS.quantile, capacity=calib.capacity,
                      spill_capacity=calib.spill_capacity, count_mean=calib.count_mean,
                      count_max=calib.count_max, frac_steps_spill=calib.frac_steps_spill,
                      frac_steps_fallback=calib.frac_steps_fallback)
    return capacity, spill, report


def stats_dict(stats) -> dict:
    return {name: int(value) for name, value in stats._asdict().items()}


def write_json(path: str, payload: dict, every_process: bool = False) -> None:
    """Writes `payload` (on process 0 only, unless every_process)."""
    if jax.process_index() != 0 and not every_process:
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)


_TABLE = [("method", "method", "s"), ("kernels", "kernel_impl", "s"),
          ("C", "capacity", "d"), ("S", "spill_capacity", "d"),
          ("compile s", "compile_s", ".2f"), ("tokens/s", "tokens_per_s", ".0f"),
          ("ms/token mean", "token_latency_ms_mean", ".3f"),
          ("p50", "token_latency_ms_p50", ".3f"), ("p99", "token_latency_ms_p99", ".3f"),
          ("spilled rows", "spilled_rows", "d"), ("fallback calls", "fallback_steps", "d"),
          ("same tokens", "same_tokens", "")]


def benchmark(base, mesh, params, prompts, ep: int, setup: dict) -> dict:
    """Times every method of --benchmark_methods; returns the JSON payload."""
    methods = [parse_method(m) for m in FLAGS.benchmark_methods]
    cs, calibration = (None, None, None), None
    if any(s == "cap_and_spill" for s, _ in methods):
        cs = capacities(base, mesh, params, prompts, ep)
        calibration = cs[2] if cs[2] is not None else dict(
            source="flags", capacity=cs[0], spill_capacity=cs[1])
    runs = FLAGS.benchmark_steps
    rows, reference = [], None
    for strategy, transport in methods:
        cfg = method_config(base, strategy, transport, cs, mesh)
        name = strategy if strategy == "dense" else f"{strategy}:{transport}"
        model, args = make_model(cfg, mesh, params)
        prepared = prepare_generation(model, args, *prompts, max_new_tokens=FLAGS.tokens,
                                      mesh=mesh)
        progress = Progress(runs, name) if show_progress(runs, 20) else None
        timing = time_generation(prepared, runs, FLAGS.benchmark_warmup, on_run=progress)
        if progress is not None:
            progress.close()
        tokens = timing.result.tokens
        reference = tokens if reference is None else reference
        row = dict(method=name, strategy=strategy, transport=transport,
                   kernel_impl=cfg.moe.kernel_impl, capacity=cfg.moe.capacity,
                   spill_capacity=cfg.moe.spill_capacity, **timing.summary(),
                   **stats_dict(timing.result.stats),
                   same_tokens=bool(np.array_equal(tokens, reference)))
        rows.append(row)
        say(f"  {name}: {row['tokens_per_s']:.0f} tokens/s, "
            f"{row['token_latency_ms_mean']:.3f} ms/token (compiled in {row['compile_s']:.1f} s)")
    say(f"\n{runs} timed runs of {FLAGS.batch} x {FLAGS.tokens} new tokens per method "
        f"(after {FLAGS.benchmark_warmup} warm-up runs; latency = run time / new tokens "
        "per sequence):\n")
    say(format_table(rows, _TABLE))
    identical = all(r["same_tokens"] for r in rows)
    say(f"\n{'PASS' if identical else 'FAIL'}: the {len(rows)} methods generate "
        f"{'the same' if identical else 'different'} tokens")
    return dict(setup=setup, calibration=calibration, methods=rows, tokens_identical=identical,
                tokens=reference.tolist())


def make_mesh():
    """(mesh, ep): the ("ep",) mesh, or ("data", "ep") with --data_parallel > 1."""
    devices = jax.devices()
    data = FLAGS.data_parallel
    if data < 1:
        raise app.UsageError(f"--data_parallel={data} must be >= 1")
    ep = FLAGS.ep if FLAGS.ep is not None else len(devices) // data
    if ep < 1 or data * ep > len(devices):
        raise app.UsageError(f"--ep={ep} x --data_parallel={data} needs {data * ep} devices, "
                             f"found {len(devices)}")
    if jax.process_count() > 1 and data * ep != len(devices):
        raise app.UsageError(f"--ep={ep} x --data_parallel={data}: a multi-process run puts "
                             f"all {len(devices)} devices of its processes on the mesh")
    if FLAGS.batch % (data * ep):
        raise app.UsageError(f"--batch={FLAGS.batch} must be a multiple of --ep={ep} x "
                             f"--data_parallel={data} (each decode step's tokens are split "
                             "evenly over the ranks)")
    if FLAGS.experts % ep:
        raise app.UsageError(f"--experts={FLAGS.experts} must be a multiple of --ep={ep}")
    return mj.expert_mesh(ep, data, devices), ep


def load_params(base, mesh, ep):
    """(config, params): restored from --checkpoint_dir, or random (and saved
    there when the directory holds no checkpoint)."""
    if FLAGS.checkpoint_dir:
        saved = checkpoint.load_config(FLAGS.checkpoint_dir)
        if saved is not None:
            base = saved.replace(strategy="ragged", transport=base.moe.transport,
                                 data_axes=data_axes(),
                                 max_len=max(saved.max_len, FLAGS.prompt_len + FLAGS.tokens))
            params = checkpoint.restore_params(FLAGS.checkpoint_dir, base, mesh)
            say(f"restored parameters from {os.path.abspath(FLAGS.checkpoint_dir)} onto "
                f"{ep} ranks (saved config: d_model={saved.d_model}, "
                f"layers={saved.num_layers}, experts={saved.moe.num_experts})")
            return base, params
    params = init_params(jax.random.key(FLAGS.seed), base)
    if FLAGS.checkpoint_dir:
        path = checkpoint.save_params(FLAGS.checkpoint_dir, params, base, mesh=mesh)
        say(f"saved random parameters (seed {FLAGS.seed}) to {path}, expert weights "
            f"split over {ep} ranks")
    else:
        say(f"random parameters (seed {FLAGS.seed})")
    return base, params


def make_prompts(vocab_size: int):
    rng = np.random.default_rng(FLAGS.seed)
    lengths = rng.integers(1, FLAGS.prompt_len + 1, size=FLAGS.batch)
    prompts = pad_prompts([rng.integers(1, vocab_size, size=n).tolist() for n in lengths],
                          length=FLAGS.prompt_len)
    say(f"prompts: {FLAGS.batch} sequences of {lengths.min()}..{lengths.max()} tokens "
        f"(left-padded to {FLAGS.prompt_len}); {FLAGS.tokens} new tokens each")
    return prompts


def tokens_path(path: str) -> str | None:
    """--tokens_out for this process: "{process}" in it becomes the process
    index (every process writes its own file); without it process 0 writes."""
    if "{process}" in path:
        return path.replace("{process}", str(jax.process_index()))
    return path if jax.process_index() == 0 else None


def write_tokens(payload: dict) -> None:
    path = tokens_path(FLAGS.tokens_out) if FLAGS.tokens_out else None
    if path is not None:
        write_json(path, dict(payload, process_id=jax.process_index()), every_process=True)


def start_processes() -> None:
    """Joins the jax.distributed run the flags describe (if any)."""
    if FLAGS.coordinator is None:
        if FLAGS.num_processes != 1:
            raise app.UsageError("--num_processes > 1 needs --coordinator")
        return
    ids = None if FLAGS.local_device_ids is None else [int(i) for i in FLAGS.local_device_ids]
    try:
        initialize(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id, ids)
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def main(argv):
    del argv
    cli.require_file("calibrate_from", FLAGS.calibrate_from)
    if FLAGS.capacity is not None and FLAGS.capacity < 1:
        raise app.UsageError(f"--capacity={FLAGS.capacity} must be >= 1")
    if FLAGS.spill_capacity is not None and FLAGS.spill_capacity < 0:
        raise app.UsageError(f"--spill_capacity={FLAGS.spill_capacity} must be >= 0")
    for flag in ("record_traces", "tokens_out", "benchmark_out"):
        cli.make_parent(flag, getattr(FLAGS, flag))
    logging.set_verbosity(logging.WARNING)  # orbax logs every save and restore at INFO
    start_processes()
    mesh, ep = make_mesh()
    devices = jax.devices()
    procs = (f" in {jax.process_count()} processes ({jax.local_device_count()} each)"
             if jax.process_count() > 1 else "")
    groups = f"{FLAGS.data_parallel} data x " if FLAGS.data_parallel > 1 else ""
    say(f"moe_jax {mj.__version__}: {FLAGS.variant} decoder on {groups}{ep} of "
        f"{len(devices)} {devices[0].platform} devices{procs}")
    base = build_config(strategy="ragged", transport=FLAGS.transport)
    base, params = load_params(base, mesh, ep)
    say(f"model: vocab={base.vocab_size} d_model={base.d_model} heads={base.num_heads} "
        f"layers={base.num_layers} experts={base.moe.num_experts} top_k={base.moe.top_k} "
        f"ffn={base.moe.ffn_size} max_len={base.max_len} matmul={base.moe.matmul}")
    prompts = make_prompts(base.vocab_size)
    setup = dict(platform=devices[0].platform, devices=len(devices), ep=ep,
                 data_parallel=FLAGS.data_parallel,
                 num_processes=jax.process_count(),
                 variant=FLAGS.variant, batch=FLAGS.batch, prompt_len=FLAGS.prompt_len,
                 new_tokens=FLAGS.tokens, matmul=FLAGS.matmul, seed=FLAGS.seed,
                 vocab_size=base.vocab_size,
                 d_model=base.d_model, num_heads=base.num_heads, num_layers=base.num_layers,
                 num_experts=base.moe.num_experts, top_k=base.moe.top_k,
                 ffn_size=base.moe.ffn_size)

    if FLAGS.benchmark_steps > 0:
        payload = benchmark(base, mesh, params, prompts, ep, setup)
        if FLAGS.benchmark_out:
            write_json(FLAGS.benchmark_out, payload)
            say(f"wrote {FLAGS.benchmark_out}")
        write_tokens(dict(setup, method="benchmark", tokens=payload["tokens"]))
        if not payload["tokens_identical"]:
            sys.exit(1)
        return

    cs = (None, None, None)
    if FLAGS.strategy == "cap_and_spill":
        cs = capacities(base, mesh, params, prompts, ep)
    cfg = method_config(base, FLAGS.strategy, FLAGS.transport, cs, mesh)
    moe = cfg.moe
    say(f"strategy: {moe.strategy}, transport {moe.transport}, kernels {moe.kernel_impl}"
        + (f" (C={moe.capacity}, S={moe.spill_capacity})"
           if moe.strategy == "cap_and_spill" else ""))

    result, first = run(cfg, mesh, params, prompts, record=bool(FLAGS.record_traces))
    again, second = run(cfg, mesh, params, prompts, record=bool(FLAGS.record_traces),
                        label="generate (compiled)")
    assert np.array_equal(again.tokens, result.tokens)
    new = FLAGS.batch * FLAGS.tokens
    say(f"generated {new} tokens: {first:.2f} s with compilation, {second:.3f} s compiled "
        f"({new / second:.0f} tokens/s)")
    for b in range(min(FLAGS.batch, 4)):
        prompt = prompts[0][b][prompts[1][b]].tolist()
        say(f"  seq {b}: {prompt} -> {result.tokens[b].tolist()}")
    s = result.stats
    say(f"dispatch over {cfg.num_layers} layers x {FLAGS.tokens} steps: rows {int(s.rows)}, "
        f"largest peer stream {int(s.max_peer_rows)}, spilled rows {int(s.spilled_rows)} "
        f"({int(s.spill_steps)} calls), fallback rows {int(s.overflow_rows)} "
        f"({int(s.fallback_steps)} calls)")
    write_tokens(dict(setup, strategy=moe.strategy, transport=moe.transport,
                      kernel_impl=moe.kernel_impl, capacity=moe.capacity,
                      spill_capacity=moe.spill_capacity, stats=stats_dict(s),
                      tokens=result.tokens.tolist()))
    if FLAGS.replicate_hot_experts > 0:
        replicated_run(cfg, mesh, params, prompts, ep, result)
    if FLAGS.record_traces:
        if jax.process_index() == 0:
            mj.save_jsonl(result.traces, FLAGS.record_traces)
        calib = mj.calibrate(result.traces, FLAGS.quantile, num_groups=FLAGS.data_parallel)
        say(f"wrote {len(result.traces)} routing traces to {FLAGS.record_traces} "
            f"(they calibrate to C={calib.capacity} S={calib.spill_capacity} at "
            f"q={FLAGS.quantile})")


def replicated_run(cfg, mesh, params, prompts, ep: int, result) -> None:
    """--replicate_hot_experts: placements from `result`'s routing (recorded
    again if it has none), the same generation on slot weights, same tokens."""
    if FLAGS.spare_slots < 1:
        raise app.UsageError(f"--spare_slots={FLAGS.spare_slots} must be >= 1")
    traces = result.traces
    if traces is None:
        traces = run(cfg, mesh, params, prompts, record=True, label="record routing")[0].traces
    experts = cfg.moe.num_experts
    slots = experts // ep + FLAGS.spare_slots
    trackers = [mj.LoadTracker(experts) for _ in range(cfg.num_layers)]
    for trace in sorted(traces, key=lambda t: (t.step, t.layer)):
        trackers[trace.layer].update_from_trace(trace)
    if FLAGS.replica_choice == "balanced":
        placements = [mj.Placement.spread(experts, ep, slots)] * cfg.num_layers
        say(f"hot-expert replication: S={slots} slots per rank, balanced rule on the spread "
            f"placement {placements[0].slot_expert.tolist()}")
    else:
        placements = [mj.propose(t, ep, slots, FLAGS.replicate_hot_experts) for t in trackers]
        say(f"hot-expert replication: S={slots} slots per rank, up to "
            f"{FLAGS.replicate_hot_experts} replicated experts per layer")
    if FLAGS.replica_choice == "local":   # the expected-load model is the local rule's
        for i, (tracker, placement) in enumerate(zip(trackers, placements)):
            before = expected_rank_loads(mj.Placement.default(experts, ep, slots), tracker)
            after = expected_rank_loads(placement, tracker)
            say(f"  layer {i}: slots {placement.slot_expert.tolist()}; busiest/mean expected "
                f"rows {before.max() / before.mean():.2f} -> {after.max() / after.mean():.2f}")
    replicated, seconds = run(cfg, mesh, replicate_params(params, placements), prompts,
                              label="generate (replicated)", placements=placements)
    same = np.array_equal(replicated.tokens, result.tokens)
    say(f"replicated run: {seconds:.2f} s with compilation; tokens "
        f"{'identical to' if same else 'DIFFER from'} the unreplicated run's")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main)

"""Greedy generation with a small Mixtral-style MoE decoder on 8 CPU devices.

    python examples/generate.py [--strategy=cap_and_spill] [--ep=8] [--tokens=24]
        [--variant=linen|nnx] [--record_traces=routing.jsonl]
        [--calibrate_from=routing.jsonl] [--checkpoint_dir=/tmp/moe_ckpt]

Builds the decoder (random weights, or restored from --checkpoint_dir; a
directory without a checkpoint gets one written), generates --tokens tokens
for a batch of random left-padded prompts in one jitted program (prefill,
then a scan over decode steps with a fixed-length KV cache), and prints the
tokens, the dispatch counters and the time. For cap_and_spill, C and S come
from --capacity/--spill_capacity, else from the trace in --calibrate_from,
else from a trace recorded by a first (ragged) run of the same prompts.
Every strategy and --ep size generates the same tokens.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from flax import nnx  # noqa: E402

import moe_jax as mj  # noqa: E402
from moe_jax import checkpoint  # noqa: E402
from moe_jax.models import (DecoderConfig, MixtralLinen, MixtralNnx, init_params,  # noqa: E402
                            nnx_load_params)
from moe_jax.models.generate import generate, pad_prompts  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("strategy", "cap_and_spill", ["dense", "max_counts", "cap_and_spill", "ragged"],
                  "MoE dispatch strategy.")
flags.DEFINE_integer("ep", 8, "Expert-parallel ranks (CPU devices on the mesh axis 'ep').")
flags.DEFINE_integer("tokens", 24, "New tokens to generate per sequence.")
flags.DEFINE_integer("batch", 8, "Prompts in the batch (a multiple of --ep).")
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
flags.DEFINE_integer("seed", 0, "Seed of the weights and prompts.")
flags.DEFINE_integer("vocab", 256, "Vocabulary size.")
flags.DEFINE_integer("d_model", 64, "Model width.")
flags.DEFINE_integer("heads", 4, "Attention heads.")
flags.DEFINE_integer("layers", 2, "Decoder blocks.")
flags.DEFINE_integer("experts", 8, "Experts per MoE layer (a multiple of --ep).")
flags.DEFINE_integer("top_k", 2, "Experts per token.")
flags.DEFINE_integer("ffn", 128, "Width of each expert.")
flags.DEFINE_enum("progress", "auto", ["auto", "on", "off"],
                  "Progress bar per decode step (auto: on for runs of >= 64 tokens).")


class Progress:
    """A decode-step progress bar: tqdm when installed, else plain text on stderr."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done = total, label, 0
        try:
            from tqdm import tqdm  # optional
            self.bar = tqdm(total=total, desc=label, unit="step", leave=False)
        except ImportError:
            self.bar = None

    def __call__(self, step) -> None:
        step = int(step)
        if step <= self.done:  # a step reported by more than one device
            return
        if self.bar is not None:
            self.bar.update(step - self.done)
        else:
            width = 30
            filled = width * step // self.total
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                             f"{step}/{self.total}")
            if step == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        self.done = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def build_config(**changes) -> DecoderConfig:
    return DecoderConfig.create(vocab_size=FLAGS.vocab, d_model=FLAGS.d_model, num_heads=FLAGS.heads,
                                num_layers=FLAGS.layers, num_experts=FLAGS.experts,
                                top_k=FLAGS.top_k, ffn_size=FLAGS.ffn,
                                max_len=FLAGS.prompt_len + FLAGS.tokens, **changes)


def run(cfg, mesh, params, prompts, record=False, label="generate"):
    """Generates with the chosen Flax variant; returns (result, seconds)."""
    if FLAGS.variant == "nnx":
        model, args = nnx_load_params(MixtralNnx(cfg, mesh=mesh, rngs=nnx.Rngs(0)), params), None
    else:
        model, args = MixtralLinen(cfg, mesh), params
    show = FLAGS.progress == "on" or (FLAGS.progress == "auto" and FLAGS.tokens >= 64)
    progress = Progress(FLAGS.tokens - 1, label) if show and FLAGS.tokens > 1 else None
    start = time.perf_counter()
    result = generate(model, args, *prompts, max_new_tokens=FLAGS.tokens, mesh=mesh,
                      record_traces=record, on_step=progress)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return result, seconds


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save and restore at INFO
    devices = jax.devices()
    if FLAGS.ep > len(devices):
        raise app.UsageError(f"--ep={FLAGS.ep} needs {FLAGS.ep} devices, found {len(devices)}")
    if FLAGS.batch % FLAGS.ep:
        raise app.UsageError(f"--batch={FLAGS.batch} must be a multiple of --ep={FLAGS.ep} "
                             "(each decode step's tokens are split evenly over the ranks)")
    if FLAGS.strategy != "dense" and FLAGS.experts % FLAGS.ep:
        raise app.UsageError(f"--experts={FLAGS.experts} must be a multiple of --ep={FLAGS.ep}")
    mesh = jax.make_mesh((FLAGS.ep,), ("ep",), devices=devices[:FLAGS.ep],
                         axis_types=(jax.sharding.AxisType.Auto,))
    print(f"moe_jax {mj.__version__}: {FLAGS.variant} decoder on {FLAGS.ep} of {len(devices)} "
          f"{devices[0].platform} devices")

    # Parameters: restored, or random (and saved when a checkpoint dir is given).
    base = build_config(strategy="ragged")
    params = None
    if FLAGS.checkpoint_dir:
        saved = checkpoint.load_config(FLAGS.checkpoint_dir)
        if saved is not None:
            base = saved.replace(strategy="ragged",
                                 max_len=max(saved.max_len, FLAGS.prompt_len + FLAGS.tokens))
            params = checkpoint.restore_params(FLAGS.checkpoint_dir, base, mesh)
            print(f"restored parameters from {os.path.abspath(FLAGS.checkpoint_dir)} onto "
                  f"{FLAGS.ep} ranks (saved config: d_model={saved.d_model}, "
                  f"layers={saved.num_layers}, experts={saved.moe.num_experts})")
    if params is None:
        params = init_params(jax.random.key(FLAGS.seed), base)
        if FLAGS.checkpoint_dir:
            path = checkpoint.save_params(FLAGS.checkpoint_dir, params, base, mesh=mesh)
            print(f"saved random parameters (seed {FLAGS.seed}) to {path}, expert weights "
                  f"split over {FLAGS.ep} ranks")
        else:
            print(f"random parameters (seed {FLAGS.seed})")
    print(f"model: vocab={base.vocab_size} d_model={base.d_model} heads={base.num_heads} "
          f"layers={base.num_layers} experts={base.moe.num_experts} top_k={base.moe.top_k} "
          f"ffn={base.moe.ffn_size} max_len={base.max_len}")

    rng = np.random.default_rng(FLAGS.seed)
    lengths = rng.integers(1, FLAGS.prompt_len + 1, size=FLAGS.batch)
    prompts = pad_prompts([rng.integers(1, base.vocab_size, size=n).tolist() for n in lengths],
                          length=FLAGS.prompt_len)
    print(f"prompts: {FLAGS.batch} sequences of {lengths.min()}..{lengths.max()} tokens "
          f"(left-padded to {FLAGS.prompt_len}); {FLAGS.tokens} new tokens each")

    changes = {}
    if FLAGS.strategy == "cap_and_spill":
        calib, source = None, None
        if FLAGS.calibrate_from:
            # Counted for --ep ranks, whatever EP size the traces were recorded at.
            traces = mj.load_jsonl(FLAGS.calibrate_from)
            calib = mj.calibrate(traces, FLAGS.quantile, num_ranks=FLAGS.ep)
            source = (f"{len(traces)} traces in {FLAGS.calibrate_from} (recorded at "
                      f"{traces[0].num_ranks} ranks, counted for {FLAGS.ep})")
        elif FLAGS.capacity is None or FLAGS.spill_capacity is None:
            result, _ = run(base, mesh, params, prompts, record=True, label="calibration run")
            calib, source = mj.calibrate(result.traces, FLAGS.quantile), \
                f"{len(result.traces)} traces of a ragged calibration run"
        capacity = FLAGS.capacity if FLAGS.capacity is not None else calib.capacity
        spill = FLAGS.spill_capacity if FLAGS.spill_capacity is not None else calib.spill_capacity
        if calib is not None:
            print(f"calibrated at q={FLAGS.quantile} from {source}: C={calib.capacity} "
                  f"S={calib.spill_capacity} (per-peer counts: mean {calib.count_mean:.1f}, "
                  f"max {calib.count_max}; {calib.frac_steps_spill:.1%} of dispatches spill, "
                  f"{calib.frac_steps_fallback:.1%} need the fallback)")
        changes = dict(capacity=capacity, spill_capacity=spill)
    cfg = base.replace(strategy=FLAGS.strategy, **changes)
    print(f"strategy: {cfg.moe.strategy}" + (
        f" (C={cfg.moe.capacity}, S={cfg.moe.spill_capacity})"
        if cfg.moe.strategy == "cap_and_spill" else ""))

    result, first = run(cfg, mesh, params, prompts, record=bool(FLAGS.record_traces))
    again, second = run(cfg, mesh, params, prompts, record=bool(FLAGS.record_traces),
                        label="generate (compiled)")
    assert np.array_equal(again.tokens, result.tokens)
    new = FLAGS.batch * FLAGS.tokens
    print(f"generated {new} tokens: {first:.2f} s with compilation, {second:.3f} s compiled "
          f"({new / second:.0f} tokens/s)")
    for b in range(min(FLAGS.batch, 4)):
        prompt = prompts[0][b][prompts[1][b]].tolist()
        print(f"  seq {b}: {prompt} -> {result.tokens[b].tolist()}")
    s = result.stats
    print(f"dispatch over {cfg.num_layers} layers x {FLAGS.tokens} steps: rows {int(s.rows)}, "
          f"largest peer stream {int(s.max_peer_rows)}, spilled rows {int(s.spilled_rows)} "
          f"({int(s.spill_steps)} calls), fallback rows {int(s.overflow_rows)} "
          f"({int(s.fallback_steps)} calls)")
    if FLAGS.record_traces:
        mj.save_jsonl(result.traces, FLAGS.record_traces)
        calib = mj.calibrate(result.traces, FLAGS.quantile)
        print(f"wrote {len(result.traces)} routing traces to {FLAGS.record_traces} "
              f"(they calibrate to C={calib.capacity} S={calib.spill_capacity} at "
              f"q={FLAGS.quantile})")


if __name__ == "__main__":
    app.run(main)

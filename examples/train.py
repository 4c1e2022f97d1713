"""Train the example MoE decoder on a synthetic task with every dispatch strategy.

    python examples/train.py [--strategies=dense,max_counts,cap_and_spill,ragged]
        [--variant=linen|nnx] [--transport=lax] [--ep=8] [--data_parallel=1]
        [--steps=300] [--batch=32] [--seq_len=16] [--learning_rate=1e-3]
        [--plot=docs/training_loss.png] [--curves_out=curves.json]
        [--checkpoint_dir=CKPT_DIR] [--platform=cpu|gpu]

Trains the decoder (moe_jax.models, linen or nnx) with optax's Adam on a
noisy bigram language (moe_jax.models.train_task: next token = a fixed
permutation of the previous one, or with probability --noise a random
token), loss = next-token cross-entropy + the MoE layers' load-balancing
and z-losses. Every strategy of --strategies starts from the same weights
and sees the same batches; the run prints each one's loss curve against the
first's (the reference, `dense` by default, data-parallel on the same
mesh): with XLA's expert matmul (--matmul=xla) the curves agree within
rounding, with the row-invariant one (--matmul=row_invariant) bit for bit;
each is checked against --tolerance (max relative difference over the
steps; 0: the same bits); the exit status is 1 if a curve is further off or
the loss did not fall. --plot saves the curves
as a PNG (needs matplotlib, the [bench] extra; skipped without it).

--checkpoint_dir: if it holds a training state (parameters, optimizer
state, step), every strategy starts from it, restored onto its own mesh
whatever EP size wrote it, and trains on to --steps; at the end the first
strategy's state is saved there (expert weights and their optimizer
moments split over the expert axis), ready to resume on any EP size.

Devices: 8 CPU devices by default (XLA_FLAGS); --platform=gpu uses the GPUs.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags, logging  # noqa: E402

import moe_jax as mj  # noqa: E402
from moe_jax import checkpoint, cli  # noqa: E402
from moe_jax.config import STRATEGIES, TRANSPORTS  # noqa: E402
from moe_jax.models.flags import define_model_flags  # noqa: E402
from moe_jax.models import DecoderConfig, init_params, nnx_params  # noqa: E402
from moe_jax.models import train_linen, train_nnx  # noqa: E402
from moe_jax.models.train_task import BigramTask  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("strategies", ["dense", "max_counts", "cap_and_spill", "ragged"],
                  "Strategies to train, each from the same start; the first is the reference.")
flags.DEFINE_enum("variant", "linen", ["linen", "nnx"], "Flax API of the model.")
flags.DEFINE_enum("transport", "lax", list(TRANSPORTS), "How buffers cross ranks.")
flags.DEFINE_enum("matmul", "xla", ["xla", "row_invariant", "auto", "cutlass"],
                  "Router and expert matmuls (MoEConfig.matmul): row_invariant makes every "
                  "strategy train bit for bit like dense (run with --tolerance=0 to check; "
                  "docs/training.md).")
flags.DEFINE_enum("platform", "cpu", ["cpu", "gpu"], "Devices to train on.")
flags.DEFINE_integer("ep", None, "Expert-parallel ranks (default: all devices / "
                     "--data_parallel).")
flags.DEFINE_integer("data_parallel", 1, "Data-parallel groups (a ('data', 'ep') mesh).")
flags.DEFINE_integer("steps", 300, "Training steps per strategy.")
flags.DEFINE_integer("batch", 32, "Sequences per step (batch x seq_len tokens must split "
                     "evenly over the ranks).")
flags.DEFINE_integer("seq_len", 16, "Tokens per sequence.")
flags.DEFINE_float("noise", 0.1, "Probability of a random next token in the task.")
flags.DEFINE_float("learning_rate", 1e-3, "Adam learning rate.")
define_model_flags()
flags.DEFINE_integer("capacity", None, "C of cap_and_spill (default: half the mean "
                     "per-peer stream, so training spills and falls back).")
flags.DEFINE_integer("spill_capacity", None, "S of cap_and_spill (default: C / 2).")
flags.DEFINE_float("load_balance_coef", 1e-2, "Weight of the load-balancing loss.")
flags.DEFINE_float("router_z_coef", 1e-3, "Weight of the router z-loss.")
flags.DEFINE_float("tolerance", 1e-2, "Largest relative difference between a strategy's "
                   "loss curve and the reference's (0: bitwise). With XLA's matmul the "
                   "curves start within ~1e-6 and drift apart once a near-tie routing "
                   "decision rounds the other way.")
flags.DEFINE_integer("seed", 0, "Seed of the weights and the task.")
flags.DEFINE_string("plot", None, "Save the loss curves to this PNG (needs matplotlib).")
flags.DEFINE_string("curves_out", None, "Write the loss curves and the setup as JSON.")
flags.DEFINE_string("checkpoint_dir", None, "Resume every strategy from the training state "
                    "here (any EP size) and save the first strategy's there at the end.")
flags.DEFINE_integer("log_every", 50, "Print the loss every this many steps.")

VARIANT_FILE = "train_variant.json"   # which Flax variant wrote a training state


def make_mesh():
    devices = jax.devices()
    data = FLAGS.data_parallel
    ep = FLAGS.ep if FLAGS.ep is not None else len(devices) // data
    if ep < 1 or data < 1 or ep * data > len(devices):
        raise app.UsageError(f"--ep={ep} x --data_parallel={data} needs {ep * data} devices, "
                             f"found {len(devices)}")
    if (FLAGS.batch * FLAGS.seq_len) % (ep * data):
        raise app.UsageError(f"--batch x --seq_len = {FLAGS.batch * FLAGS.seq_len} tokens do "
                             f"not split evenly over {ep * data} ranks")
    if FLAGS.experts % ep:
        raise app.UsageError(f"--experts={FLAGS.experts} must be a multiple of --ep={ep}")
    return mj.expert_mesh(ep, data, devices), ep


def strategy_config(strategy: str, ep: int) -> DecoderConfig:
    tokens_per_rank = FLAGS.batch * FLAGS.seq_len // (ep * FLAGS.data_parallel)
    capacity = FLAGS.capacity or max(1, tokens_per_rank * FLAGS.top_k // (2 * ep))
    spill = FLAGS.spill_capacity if FLAGS.spill_capacity is not None else capacity // 2
    return DecoderConfig.create(
        vocab_size=FLAGS.vocab, d_model=FLAGS.d_model, num_heads=FLAGS.heads,
        num_layers=FLAGS.layers, num_experts=FLAGS.experts, top_k=FLAGS.top_k,
        ffn_size=FLAGS.ffn, max_len=FLAGS.seq_len, strategy=strategy,
        transport="lax" if strategy == "dense" else FLAGS.transport, matmul=FLAGS.matmul,
        capacity=capacity if strategy == "cap_and_spill" else None,
        spill_capacity=spill if strategy == "cap_and_spill" else None,
        load_balance_coef=FLAGS.load_balance_coef, router_z_coef=FLAGS.router_z_coef,
        data_axes=("data",) if FLAGS.data_parallel > 1 else ())


class Trainer:
    """One strategy's model and optimizer in the chosen Flax variant."""

    def __init__(self, cfg, mesh, optimizer, params):
        self.cfg, self.mesh, self.optimizer = cfg, mesh, optimizer
        if FLAGS.variant == "linen":
            self.state = train_linen.init_state(params, optimizer, mesh, cfg)
            self._step = train_linen.make_step(cfg, mesh, optimizer)
        else:
            self.model, self.opt = train_nnx.build(cfg, mesh, optimizer, params)
            self._step = train_nnx.make_step(cfg, mesh)

    def step(self, inputs, targets):
        if FLAGS.variant == "linen":
            self.state, metrics = self._step(self.state, inputs, targets)
            return metrics
        return self._step(self.model, self.opt, inputs, targets)

    def done_steps(self) -> int:
        if FLAGS.variant == "linen":
            return int(self.state["step"])
        return int(self.opt.step[...])

    def save(self, directory: str) -> None:
        tree = self.state if FLAGS.variant == "linen" else train_nnx.state_tree(self.model,
                                                                                self.opt)
        checkpoint.save_state(directory, tree, self.cfg, mesh=self.mesh, force=True)
        with open(os.path.join(directory, VARIANT_FILE), "w", encoding="utf-8") as f:
            json.dump(dict(variant=FLAGS.variant), f)

    def restore(self, directory: str) -> None:
        path = os.path.join(directory, VARIANT_FILE)
        saved = json.load(open(path, encoding="utf-8"))["variant"] if os.path.exists(
            path) else FLAGS.variant
        if saved != FLAGS.variant:
            raise app.UsageError(f"--checkpoint_dir={directory} holds a {saved} training "
                                 f"state; resume it with --variant={saved}")
        if FLAGS.variant == "linen":
            abstract = train_linen.abstract_state(self.cfg, self.optimizer)
            self.state = checkpoint.restore_state(directory, abstract, self.cfg, self.mesh)
        else:
            abstract = train_nnx.abstract_state(self.cfg, self.optimizer)
            tree = checkpoint.restore_state(directory, abstract, self.cfg, self.mesh)
            train_nnx.load_state_tree(self.model, self.opt, tree)

    def params(self) -> dict:
        if FLAGS.variant == "linen":
            return self.state["params"]
        return nnx_params(self.model)


def train(strategy: str, mesh, ep: int, params, task: BigramTask):
    """Trains one strategy; returns (trainer, cross-entropy per step, stats,
    s/step, first step)."""
    cfg = strategy_config(strategy, ep)
    trainer = Trainer(cfg, mesh, optax.adam(FLAGS.learning_rate), params)
    start = 0
    if FLAGS.checkpoint_dir and os.path.isdir(
            os.path.join(FLAGS.checkpoint_dir, "train_state")):
        trainer.restore(FLAGS.checkpoint_dir)
        start = trainer.done_steps()
        if start >= FLAGS.steps:
            raise app.UsageError(f"--steps={FLAGS.steps}: the training state in "
                                 f"{FLAGS.checkpoint_dir} is already at step {start}")
        print(f"  restored the training state at step {start} from {FLAGS.checkpoint_dir} "
              f"onto {ep} ranks", flush=True)
    losses, stats = [], mj.DispatchStats.zeros()
    begin = None
    for step in range(start, FLAGS.steps):
        metrics = trainer.step(*task.batch(step, FLAGS.batch))
        losses.append(float(metrics.cross_entropy))
        stats = stats + jax.device_get(metrics.stats)
        if begin is None:
            begin = time.perf_counter()      # time after the first (compiling) step
        if FLAGS.log_every and (step + 1) % FLAGS.log_every == 0:
            print(f"  {strategy} step {step + 1}: loss {losses[-1]:.4f} "
                  f"(+ aux {float(metrics.aux_loss):.4f})", flush=True)
    per_step = (time.perf_counter() - begin) / max(len(losses) - 1, 1) if begin else 0.0
    return trainer, np.array(losses), stats, per_step, start


def plot(curves: dict, floor: float, path: str, ep: int) -> bool:
    try:
        import matplotlib  # noqa: PLC0415 (optional: the [bench] extra)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return False
    names = list(curves)
    reference = curves[names[0]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True,
                                      gridspec_kw=dict(height_ratios=(2, 1)))
    for name in names:
        top.plot(np.arange(1, len(curves[name]) + 1), curves[name], label=name,
                 lw=1.2 if name == names[0] else 0.9, ls="-" if name == names[0] else "--")
    top.axhline(floor, color="gray", lw=0.8, ls=":", label="noise floor")
    top.set_yscale("log")
    top.set_ylabel("next-token cross-entropy (nats)")
    data = f" x data {FLAGS.data_parallel}" if FLAGS.data_parallel > 1 else ""
    top.set_title(f"{FLAGS.variant} decoder, {FLAGS.layers} MoE layers of {FLAGS.experts} "
                  f"experts (top-{FLAGS.top_k}), EP {ep}{data}, transport {FLAGS.transport}, "
                  f"matmul {FLAGS.matmul}; Adam, batch {FLAGS.batch} x {FLAGS.seq_len}",
                  fontsize=8)
    top.legend(fontsize=8)
    for name in names[1:]:
        n = min(len(curves[name]), len(reference))
        diff = np.abs(curves[name][:n] - reference[:n]) / reference[:n]
        same = np.array_equal(curves[name][:n], reference[:n])
        bottom.plot(np.arange(1, n + 1), np.maximum(diff, 1e-9), lw=0.9,
                    label=f"{name}: the same bits at every step" if same else name)
    bottom.set_yscale("log")
    bottom.set_ylabel(f"|loss - {names[0]}| / {names[0]}\n(0 drawn at 1e-9)", fontsize=8)
    bottom.set_xlabel("step")
    if len(names) > 1:
        bottom.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save and restore at INFO
    jax.config.update("jax_platforms", "cuda" if FLAGS.platform == "gpu" else "cpu")
    for s in FLAGS.strategies:
        if s not in STRATEGIES:
            raise app.UsageError(f"--strategies: unknown strategy {s!r} (one of {STRATEGIES})")
    mesh, ep = make_mesh()
    devices = jax.devices()
    print(f"moe_jax {mj.__version__}: training the {FLAGS.variant} decoder on {ep} x "
          f"{FLAGS.data_parallel} of {len(devices)} {devices[0].platform} devices, "
          f"{FLAGS.steps} steps of {FLAGS.batch} x {FLAGS.seq_len} tokens, "
          f"strategies {FLAGS.strategies}", flush=True)
    task = BigramTask(FLAGS.vocab, FLAGS.seq_len, FLAGS.noise, FLAGS.seed)
    params = init_params(jax.random.key(FLAGS.seed), strategy_config("dense", ep))
    curves, rows, first = {}, [], None
    for strategy in FLAGS.strategies:
        cfg = strategy_config(strategy, ep)
        extra = (f" (C={cfg.moe.capacity}, S={cfg.moe.spill_capacity})"
                 if strategy == "cap_and_spill" else "")
        print(f"{strategy}{extra}:", flush=True)
        trainer, losses, stats, per_step, start = train(strategy, mesh, ep, params, task)
        first = first or trainer
        curves[strategy] = losses
        rows.append(dict(strategy=strategy, start_step=start, first=float(losses[0]),
                         last=float(losses[-1]), s_per_step=per_step,
                         spilled_rows=int(stats.spilled_rows),
                         fallback_steps=int(stats.fallback_steps)))
    if FLAGS.checkpoint_dir:   # after every strategy has restored from it
        first.save(FLAGS.checkpoint_dir)
        print(f"saved {FLAGS.strategies[0]}'s training state at step {FLAGS.steps} to "
              f"{FLAGS.checkpoint_dir}", flush=True)
    reference_name = FLAGS.strategies[0]
    reference = curves[reference_name]
    ok = True
    print(f"\nnoise floor of the task: {task.noise_floor():.4f} nats; "
          f"log(vocab) = {np.log(FLAGS.vocab):.4f}")
    print(f"{'strategy':<14} {'first':>8} {'last':>8} {'max rel diff':>13} {'ms/step':>8} "
          f"{'spilled':>8} {'fallbacks':>9}")
    for row in rows:
        curve = curves[row["strategy"]]
        n = min(len(curve), len(reference))
        diff = float(np.max(np.abs(curve[:n] - reference[:n]) / reference[:n])) if n else 0.0
        row["max_rel_diff"] = diff
        # Well below a uniform guess at the end (also when resumed late).
        fell = float(np.mean(curve[-max(1, len(curve) // 4):])) < 0.5 * np.log(FLAGS.vocab)
        close = diff <= FLAGS.tolerance and (FLAGS.tolerance > 0 or
                                             np.array_equal(curve[:n], reference[:n]))
        ok &= fell and close
        print(f"{row['strategy']:<14} {row['first']:8.4f} {row['last']:8.4f} {diff:13.2e} "
              f"{1e3 * row['s_per_step']:8.1f} {row['spilled_rows']:8d} "
              f"{row['fallback_steps']:9d}" + ("" if fell else "  (loss did not fall)")
              + ("" if close else f"  (off the {reference_name} curve)"))
    print(f"\n{'PASS' if ok else 'FAIL'}: every loss fell and every curve is within "
          f"{FLAGS.tolerance:g} of {reference_name}'s")
    if FLAGS.plot:
        if plot(curves, task.noise_floor(), FLAGS.plot, ep):
            print(f"wrote {FLAGS.plot}")
    if FLAGS.curves_out:
        with open(FLAGS.curves_out, "w", encoding="utf-8") as f:
            json.dump(dict(flags={k: FLAGS[k].value for k in (
                "variant", "transport", "matmul", "platform", "ep", "data_parallel", "steps",
                "batch", "seq_len", "noise", "learning_rate", "seed")},
                noise_floor=task.noise_floor(), runs=rows,
                curves={k: v.tolist() for k, v in curves.items()}), f, indent=1)
        print(f"wrote {FLAGS.curves_out}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main)

"""Training the example decoder: examples/train.py's loss falls and every
strategy follows dense's curve; the linen and nnx steps agree; a training
state saved on 4 ranks resumes on 2 and 8 where an uninterrupted run is."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from moe_jax import checkpoint
from moe_jax.models import DecoderConfig, init_params
from moe_jax.models import train_linen, train_nnx
from moe_jax.models.train_task import BigramTask
from moe_testing import mesh_of

ROOT = Path(__file__).absolute().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"
TINY = ["--vocab=32", "--d_model=32", "--heads=4", "--layers=1", "--experts=8", "--top_k=3",
        "--ffn=32", "--batch=8", "--seq_len=8", "--learning_rate=1e-2", "--log_every=0"]
CURVE_RTOL = 1e-4   # XLA's expert matmul: the strategies' curves agree within rounding


def run_example(*flags: str, devices: int = 8, timeout: int = 400) -> str:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run([sys.executable, str(EXAMPLE), *TINY, *flags], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_example_loss_falls_and_strategies_follow_dense(tmp_path):
    curves_path, png = tmp_path / "curves.json", tmp_path / "loss.png"
    out = run_example("--steps=24", "--strategies=dense,cap_and_spill,ragged",
                      "--transport=custom_call", f"--curves_out={curves_path}",
                      f"--plot={png}", f"--tolerance={CURVE_RTOL}")
    assert "PASS" in out
    result = json.loads(curves_path.read_text())
    curves = {k: np.asarray(v) for k, v in result["curves"].items()}
    assert set(curves) == {"dense", "cap_and_spill", "ragged"}
    dense = curves["dense"]
    assert len(dense) == 24 and np.isfinite(dense).all()
    assert dense[-6:].mean() < 0.5 * dense[:3].mean(), "the loss did not fall"
    for name, curve in curves.items():
        np.testing.assert_allclose(curve, dense, rtol=CURVE_RTOL, err_msg=name)
    runs = {r["strategy"]: r for r in result["runs"]}
    assert runs["cap_and_spill"]["fallback_steps"] > 0, "C and S should force the fallback"
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        assert not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("variant, strategies", [
    ("linen", "dense,max_counts,cap_and_spill,ragged"), ("nnx", "dense,cap_and_spill")])
def test_row_invariant_strategies_train_bitwise_like_dense(tmp_path, variant, strategies):
    """--matmul=row_invariant: every strategy's loss curve is dense's, bit for
    bit (--tolerance=0), the cap-and-spill fallback taken on every step."""
    curves_path = tmp_path / "curves.json"
    out = run_example("--steps=24", f"--strategies={strategies}", f"--variant={variant}",
                      "--matmul=row_invariant", "--tolerance=0",
                      f"--curves_out={curves_path}")
    assert "PASS" in out
    result = json.loads(curves_path.read_text())
    dense = np.asarray(result["curves"]["dense"], np.float32)
    for name, curve in result["curves"].items():
        np.testing.assert_array_equal(np.asarray(curve, np.float32).view(np.uint32),
                                      dense.view(np.uint32), err_msg=name)
    runs = {r["strategy"]: r for r in result["runs"]}
    assert runs["cap_and_spill"]["fallback_steps"] > 0


def _config(strategy: str) -> DecoderConfig:
    return DecoderConfig.create(vocab_size=32, d_model=32, num_heads=4, num_layers=1,
                                num_experts=8, top_k=2, ffn_size=32, max_len=8,
                                strategy=strategy, capacity=2, spill_capacity=1,
                                transport="custom_call")


def _train_linen(cfg, mesh, optimizer, state, task, steps):
    step = train_linen.make_step(cfg, mesh, optimizer)
    losses = []
    for i in range(int(state["step"]), steps):
        state, metrics = step(state, *task.batch(i, 8))
        losses.append(float(metrics.loss))
    return state, np.asarray(losses)


def test_linen_and_nnx_steps_agree():
    cfg, mesh = _config("cap_and_spill"), mesh_of(4)
    task, optimizer = BigramTask(32, 8, seed=1), optax.adam(1e-2)
    params = init_params(jax.random.key(1), cfg)
    _, linen = _train_linen(cfg, mesh, optimizer, train_linen.init_state(params, optimizer,
                                                                         mesh, cfg), task, 6)
    model, opt = train_nnx.build(cfg, mesh, optimizer, params)
    step = train_nnx.make_step(cfg)
    nnx_losses = np.asarray([float(step(model, opt, *task.batch(i, 8)).loss) for i in range(6)])
    np.testing.assert_allclose(nnx_losses, linen, rtol=1e-6)
    assert linen[-1] < linen[0]


@pytest.mark.parametrize("variant, sizes", [("linen", (2, 8)), ("nnx", (8,))])
def test_training_state_resumes_on_another_ep_size(tmp_path, variant, sizes):
    """Saved on 4 ranks at step 4; restored on other EP sizes (expert
    weights and Adam moments resharded), the next steps' losses are the
    uninterrupted run's."""
    task, optimizer = BigramTask(32, 8, seed=2), optax.adam(1e-2)
    cfg = _config("ragged")
    params = init_params(jax.random.key(2), cfg)

    def run(mesh, state_tree, start, stop):
        """Trains steps [start, stop); returns (losses, final state tree)."""
        if variant == "linen":
            state = state_tree or train_linen.init_state(params, optimizer, mesh, cfg)
            state, losses = _train_linen(cfg, mesh, optimizer, state, task, stop)
            return losses, state
        model, opt = train_nnx.build(cfg, mesh, optimizer, params)
        if state_tree is not None:
            train_nnx.load_state_tree(model, opt, state_tree)
        step = train_nnx.make_step(cfg)
        losses = [float(step(model, opt, *task.batch(i, 8)).loss) for i in range(start, stop)]
        return np.asarray(losses), train_nnx.state_tree(model, opt)

    abstract = (train_linen.abstract_state(cfg, optimizer) if variant == "linen"
                else train_nnx.abstract_state(cfg, optimizer))
    whole, _ = run(mesh_of(4), None, 0, 7)
    _, saved = run(mesh_of(4), None, 0, 4)
    checkpoint.save_state(tmp_path, saved, cfg, mesh=mesh_of(4))
    for ep in sizes:
        restored = checkpoint.restore_state(tmp_path, abstract, cfg, mesh_of(ep))
        expert = restored["params"]["layers_0"]["moe"]["w_gate_up"] if variant == "linen" else \
            restored["model"]["layers"][0]["moe"]["w_gate_up"]
        assert expert.sharding.spec[0] == "ep" and expert.sharding.mesh.shape["ep"] == ep
        resumed, _ = run(mesh_of(ep), restored, 4, 7)
        np.testing.assert_allclose(resumed, whole[4:], rtol=1e-5,
                                   err_msg=f"resumed on {ep} ranks")


def test_restore_state_names_a_missing_state_and_a_shape_mismatch(tmp_path):
    cfg = _config("ragged")
    abstract = train_linen.abstract_state(cfg, optax.sgd(0.1))
    with pytest.raises(ValueError, match="no training state"):
        checkpoint.restore_state(tmp_path, abstract, cfg)
    state = train_linen.init_state(init_params(jax.random.key(0), cfg), optax.sgd(0.1), None,
                                   cfg)
    checkpoint.save_state(tmp_path, state, cfg)
    with pytest.raises(ValueError, match="moe.num_experts"):
        checkpoint.restore_state(tmp_path, abstract, cfg.replace(num_experts=4))


def test_bigram_task_is_deterministic_and_learnable():
    task = BigramTask(16, 6, noise=0.25, seed=3)
    a, b = task.batch(5, 4), task.batch(5, 4)
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(task.batch(6, 4)[0], a[0])
    inputs, targets = task.batch(0, 256)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    follows = np.mean(targets == task.perm()[inputs])
    assert 0.7 < follows < 0.85           # 0.75 + 0.25 / 16 expected
    assert 0 < task.noise_floor() < np.log(16)

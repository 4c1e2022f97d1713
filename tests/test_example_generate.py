"""examples/generate.py: traces it records calibrate C and S, its benchmark mode
uses them and every benchmarked method generates the recorded tokens; the
benchmark helpers and the progress bar on their own."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import moe_jax as mj
from moe_jax.models import DecoderConfig, MixtralLinen, init_params
from moe_jax.models.benchmark import format_table, time_generation
from moe_jax.models.generate import generate, pad_prompts, prepare_generation
from moe_jax.models.progress import Progress
from moe_testing import mesh_of

ROOT = Path(__file__).absolute().parents[1]
EXAMPLE = ROOT / "examples" / "generate.py"
# A tiny model: the example's compile time dominates.
TINY = ["--vocab=64", "--d_model=32", "--heads=4", "--layers=1", "--experts=4", "--top_k=2",
        "--ffn=32", "--batch=4", "--prompt_len=4", "--tokens=4", "--seed=3", "--progress=off"]


def run_example(*flags: str, devices: int = 2, timeout: int = 240) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run([sys.executable, str(EXAMPLE), *TINY, *flags], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_benchmark_uses_capacities_calibrated_from_recorded_traces(tmp_path):
    traces_path, recorded = tmp_path / "routing.jsonl", tmp_path / "tokens.json"
    out = run_example("--strategy=ragged", f"--record_traces={traces_path}",
                      f"--tokens_out={recorded}")
    assert "wrote 4 routing traces" in out  # 1 layer x (prefill + 3 decode steps)

    bench_path = tmp_path / "bench" / "bench.json"
    out = run_example("--benchmark_steps=2", "--benchmark_warmup=1", "--quantile=0.5",
                      "--benchmark_methods=cap_and_spill,ragged:custom_call",
                      f"--calibrate_from={traces_path}", f"--benchmark_out={bench_path}")
    assert "PASS: the 2 methods generate the same tokens" in out

    bench = json.loads(bench_path.read_text())
    calib = mj.calibrate(mj.load_jsonl(traces_path), 0.5, num_ranks=2)
    assert bench["calibration"]["calibrate_from"] == str(traces_path)
    assert (bench["calibration"]["capacity"], bench["calibration"]["spill_capacity"]) == \
        (calib.capacity, calib.spill_capacity)
    cap, ragged = bench["methods"]
    assert (cap["method"], ragged["method"]) == ("cap_and_spill:lax", "ragged:custom_call")
    assert (cap["capacity"], cap["spill_capacity"]) == (calib.capacity, calib.spill_capacity)
    assert ragged["capacity"] is None
    assert cap["spilled_rows"] > 0  # q=0.5 leaves pairs above C
    assert cap["rows"] == ragged["rows"] == 2 * 4 * (4 + 3)  # top_k * batch * token slots
    for method in (cap, ragged):
        assert method["runs"] == 2 and method["same_tokens"]
        assert method["tokens_per_s"] > 0
        assert (method["token_latency_ms_p50"] <= method["token_latency_ms_p99"])
    assert bench["tokens_identical"]
    assert bench["tokens"] == json.loads(recorded.read_text())["tokens"]
    assert bench["setup"]["ep"] == 2 and bench["setup"]["new_tokens"] == 4


def test_example_rejects_bad_benchmark_method():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, str(EXAMPLE), *TINY, "--benchmark_steps=1",
                           "--benchmark_methods=ragged:pigeon"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "--benchmark_methods" in proc.stderr


CFG = DecoderConfig.create(vocab_size=32, d_model=16, num_heads=2, num_layers=1, num_experts=4,
                           top_k=2, ffn_size=16, max_len=8, strategy="ragged")


def test_time_generation_runs_the_compiled_generation():
    params = init_params(jax.random.key(0), CFG)
    prompts = pad_prompts([[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]])
    model = MixtralLinen(CFG, mesh_of(2))
    prepared = prepare_generation(model, params, *prompts, max_new_tokens=3)
    timing = time_generation(prepared, runs=3, warmup=2)
    expected = generate(model, params, *prompts, max_new_tokens=3)
    np.testing.assert_array_equal(timing.result.tokens, expected.tokens)
    assert int(timing.result.stats.rows) == int(expected.stats.rows)
    summary = timing.summary()
    assert summary["runs"] == 3 and timing.run_s.shape == (3,) and (timing.run_s > 0).all()
    assert summary["tokens_per_s"] == pytest.approx(4 * 3 * 3 / timing.run_s.sum())
    assert summary["token_latency_ms_mean"] == pytest.approx(timing.run_s.mean() / 3 * 1e3)
    assert summary["token_latency_ms_p50"] <= summary["token_latency_ms_p99"]
    with pytest.raises(ValueError, match="runs"):
        time_generation(prepared, runs=0)
    with pytest.raises(ValueError, match="warmup"):
        time_generation(prepared, runs=1, warmup=0)


def test_format_table():
    rows = [dict(method="ragged", rate=12.345, c=None), dict(method="dense", rate=1.0, c=3)]
    table = format_table(rows, [("method", "method", "s"), ("rate", "rate", ".1f"),
                                ("C", "c", "d")])
    assert table.splitlines() == ["| method | rate | C |", "| --- | --- | --- |",
                                  "| ragged | 12.3 | - |", "| dense | 1.0 | 3 |"]


def test_progress_fallback_bar(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed
    stream = io.StringIO()
    with Progress(4, "decode", stream=stream, width=4) as bar:
        assert bar.bar is None
        for done in (1, 1, 0, 3, 4):  # repeats and steps back are ignored
            bar(done)
    assert stream.getvalue() == ("\rdecode [#...] 1/4\rdecode [###.] 3/4"
                                 "\rdecode [####] 4/4\n")
    quiet = io.StringIO()
    Progress(4, "x", enabled=False, stream=quiet)(2)
    assert quiet.getvalue() == ""
    with pytest.raises(ValueError, match="total"):
        Progress(0, "x")


def test_data_parallel_runs_generate_the_dense_tokens(tmp_path):
    """--data_parallel=2 --ep=2 on 4 devices: traces recorded there calibrate
    C and S per data group, and every method generates dense's tokens, the
    tokens of a 1-D run on 4 ranks."""
    traces_path, one_axis = tmp_path / "routing.jsonl", tmp_path / "tokens.json"
    run_example("--strategy=ragged", "--ep=4", f"--tokens_out={one_axis}", devices=4)
    out = run_example("--strategy=ragged", "--ep=2", "--data_parallel=2",
                      f"--record_traces={traces_path}", devices=4)
    assert "decoder on 2 data x 2 of 4 cpu devices" in out
    out = run_example("--benchmark_steps=1", "--benchmark_warmup=1", "--ep=2",
                      "--data_parallel=2", "--benchmark_methods=dense,cap_and_spill,"
                      "ragged:custom_call", f"--calibrate_from={traces_path}",
                      f"--benchmark_out={tmp_path / 'bench.json'}", devices=4)
    assert "PASS: the 3 methods generate the same tokens" in out
    bench = json.loads((tmp_path / "bench.json").read_text())
    calib = mj.calibrate(mj.load_jsonl(traces_path), 0.99, num_ranks=2, num_groups=2)
    assert (bench["calibration"]["capacity"], bench["calibration"]["spill_capacity"]) == \
        (calib.capacity, calib.spill_capacity)
    assert bench["setup"]["data_parallel"] == 2
    assert bench["tokens"] == json.loads(one_axis.read_text())["tokens"]


@pytest.mark.parametrize("variant, strategy, choice", [
    ("linen", "ragged", "local"), ("nnx", "cap_and_spill", "local"),
    ("linen", "cap_and_spill", "balanced"), ("nnx", "ragged", "balanced")])
def test_replicate_hot_experts_generates_the_same_tokens(variant, strategy, choice):
    """--replicate_hot_experts: placements from the first run's routing (or
    the spread one with the balanced rule), slot weights, the same tokens
    (the example exits 1 otherwise)."""
    out = run_example(f"--strategy={strategy}", "--ep=2", f"--variant={variant}",
                      "--replicate_hot_experts=2", f"--replica_choice={choice}", devices=2)
    assert "hot-expert replication: S=3 slots per rank" in out
    assert "tokens identical to the unreplicated run's" in out

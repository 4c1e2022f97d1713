"""examples/generate.py under jax.distributed on CPU: 2 processes x 2 CPU
devices (gloo collectives, one EP=4 mesh) generate, with every strategy, the
tokens of the single-process EP=4 run; moe_jax's CPU all-to-all custom call,
which cannot cross processes, is refused with a clear message."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from moe_jax.models import DecoderConfig
from moe_jax.models.generate import check_multiprocess

ROOT = Path(__file__).absolute().parents[1]
LAUNCH = ROOT / "examples" / "launch.py"
EXAMPLE = ROOT / "examples" / "generate.py"
TINY = ["--vocab=64", "--d_model=32", "--heads=4", "--layers=1", "--experts=4", "--top_k=2",
        "--ffn=32", "--batch=4", "--prompt_len=4", "--tokens=4", "--seed=5", "--progress=off"]


def launch(out_dir: Path, *flags: str, timeout: int = 480) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(LAUNCH), "--num_processes=2", "--devices_per_process=2",
           f"--out_dir={out_dir}", f"--timeout={timeout - 30}", "--", *TINY, *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_two_processes_generate_the_single_process_tokens(tmp_path):
    out = tmp_path / "launch"
    proc = launch(out, "--benchmark_steps=1", "--benchmark_warmup=1", "--capacity=1",
                  "--spill_capacity=1", f"--benchmark_out={out / 'bench.json'}",
                  "--benchmark_methods=dense,max_counts,cap_and_spill,ragged")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS: 2 processes generated the same tokens" in proc.stdout
    assert "PASS: the 4 methods generate the same tokens" in proc.stdout
    assert "in 2 processes (2 each)" in proc.stdout
    bench = json.loads((out / "bench.json").read_text())
    assert bench["setup"]["num_processes"] == 2 and bench["setup"]["ep"] == 4
    by_method = {m["strategy"]: m for m in bench["methods"]}
    assert by_method["ragged"]["kernel_impl"] == "reference"  # the auto choice across processes
    assert by_method["cap_and_spill"]["spilled_rows"] > 0
    assert by_method["cap_and_spill"]["fallback_steps"] > 0  # the fallback crossed processes
    assert len({m["rows"] for m in bench["methods"]}) == 1
    files = [json.loads((out / f"tokens.{i}.json").read_text()) for i in range(2)]
    assert [f["process_id"] for f in files] == [0, 1]
    assert files[0]["tokens"] == files[1]["tokens"]

    single = tmp_path / "single.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    run = subprocess.run([sys.executable, str(EXAMPLE), *TINY, "--ep=4", "--strategy=ragged",
                          f"--tokens_out={single}"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = json.loads(single.read_text())
    assert expected["num_processes"] == 1 and expected["kernel_impl"] == "custom_call"
    np.testing.assert_array_equal(np.asarray(files[0]["tokens"]),
                                  np.asarray(expected["tokens"]))
    assert np.asarray(expected["tokens"]).shape == (4, 4)


def test_cpu_custom_call_across_processes_is_refused(tmp_path):
    proc = launch(tmp_path, "--strategy=max_counts", "--transport=custom_call", timeout=300)
    assert proc.returncode == 1 and "FAIL" in proc.stdout
    log = (tmp_path / "process_0.log").read_text()
    assert "transport: the CPU all-to-all custom call is an in-process rendezvous" in log


def _fake_mesh(platform: str, processes):
    devices = np.array([types.SimpleNamespace(platform=platform, process_index=p)
                        for p in processes], dtype=object)
    return types.SimpleNamespace(devices=devices)


@pytest.mark.parametrize("changes, platform, argument", [
    (dict(strategy="max_counts", transport="custom_call"), "cpu", "transport"),
    (dict(strategy="ragged"), "cpu", "kernel_impl"),
    (dict(strategy="ragged", transport="lax"), "gpu", "transport"),
    (dict(strategy="ragged", transport="custom_call"), "gpu", "transport"),
])
def test_check_multiprocess_names_the_argument(changes, platform, argument):
    cfg = DecoderConfig.create(**changes)
    with pytest.raises(ValueError, match=f"^{argument}:"):
        check_multiprocess(cfg, _fake_mesh(platform, [0, 0, 1, 1]))
    check_multiprocess(cfg, _fake_mesh(platform, [0, 0]))  # one process: fine


@pytest.mark.parametrize("changes, platform", [
    (dict(strategy="ragged", kernel_impl="reference"), "cpu"),
    (dict(strategy="cap_and_spill", capacity=2, spill_capacity=1), "cpu"),
    (dict(strategy="dense", transport="custom_call"), "cpu"),
    (dict(strategy="cap_and_spill", capacity=2, spill_capacity=1, transport="custom_call"),
     "gpu"),  # NCCL crosses processes
    (dict(strategy="ragged", transport="nvlink"), "gpu"),  # CUDA IPC crosses processes
])
def test_check_multiprocess_accepts(changes, platform):
    check_multiprocess(DecoderConfig.create(**changes), _fake_mesh(platform, [0, 1]))

"""examples/moe_layer_cpu.py (the README's first example): every strategy
on a 1-D expert mesh and on a data x expert mesh, close to float32 dense and
routing every row."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).absolute().parents[1] / "examples" / "moe_layer_cpu.py"


def run_example(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return subprocess.run([sys.executable, str(EXAMPLE), "--steps=1", "--tokens_per_device=4",
                           *flags], env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("data, layout", [(1, "8 ep"), (2, "2 data x 4 ep"),
                                          (4, "4 data x 2 ep")])
def test_every_strategy_is_close_to_dense(data, layout):
    proc = run_example(f"--data_parallel={data}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"({layout})" in proc.stdout
    lines = re.findall(r"^\s*(\w+): rel\. error vs float32 dense ([0-9.e+-]+); rows (\d+)",
                       proc.stdout, re.M)
    assert [name for name, _, _ in lines] == ["max_counts", "cap_and_spill", "ragged"]
    for name, error, rows in lines:
        assert float(error) < 1e-2, name
        assert int(rows) == 8 * 4 * 2, name   # devices x tokens per device x top_k


def test_data_parallel_must_divide_the_devices():
    proc = run_example("--data_parallel=3")
    assert proc.returncode != 0
    assert "--data_parallel=3 must divide the 8 devices" in proc.stdout + proc.stderr

"""Command-line tools answer a bad flag or value with one line naming it."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_LINE = re.compile(r"^[IWE]\d{4} |^WARNING: ")


@pytest.mark.parametrize("argv, flag", [
    (["examples/generate.py", "--ep=3"], "--ep=3"),
    (["examples/generate.py", "--capacity=0"], "--capacity=0"),
    (["examples/generate.py", "--calibrate_from=no_such_file.jsonl"], "--calibrate_from"),
    (["examples/generate.py", "--record_traces=README.md/t.jsonl"], "--record_traces"),
    (["examples/moe_layer_cpu.py", "--tokens_per_device=0"], "--tokens_per_device=0"),
    (["-m", "benchmarks.row_matmul_bench"], "--out"),
])
def test_bad_flag_is_one_line(argv, flag, tmp_path):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line and not LOG_LINE.match(line)]
    assert len(lines) == 1 and ": error: " in lines[0] and flag in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr

"""benchmarks/row_matmul_bench.py dry run on CPU: both methods compute the
same product and land in the JSON and markdown."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_dry_run_on_cpu(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.row_matmul_bench", "--shapes=8:64:96:2,33:40:24:3",
         "--steps=2", "--warmup=1", "--calls=2", f"--out={tmp_path}", "--tag=dry"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "dry.json").read_text())
    assert data["meta"]["platform"] == "cpu"
    rows = data["results"]
    assert [(r["m"], r["dtype"]) for r in rows] == [
        (8, "bfloat16"), (8, "float32"), (33, "bfloat16"), (33, "float32")]
    for r in rows:
        assert r["rel_diff"] < 1e-5, r
        assert r["row_invariant_us"] > 0 and r["ragged_dot_us"] > 0
    md = (tmp_path / "dry.md").read_text()
    assert "| 33 | 40 | 24 | 3 | float32 |" in md

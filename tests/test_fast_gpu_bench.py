"""benchmarks/fast_gpu_bench.py dry run on CPU devices: every method it can
run there is exact and lands in the JSON and markdown."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_dry_run_on_cpu(tmp_path):
  methods = "padded,ragged,staged:cb:2x2,staged:cb:4x1,staged:cc:2x2"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.fast_gpu_bench", "--platform=cpu",
       "--cpu_devices=4", "--sizes=32", "--hidden=16", "--steps=3", "--warmup=1",
       "--matrices=2", f"--methods={methods}", f"--out={tmp_path}", "--tag=dry"],
      capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  data = json.loads((tmp_path / "dry.json").read_text())
  assert data["meta"]["platform"] == "cpu" and data["meta"]["devices"].startswith("4 x")
  by_method = {r["method"]: r for r in data["results"]}
  assert set(by_method) == set(methods.split(","))
  for name in ("padded", "ragged", "staged:cb:2x2", "staged:cb:4x1"):
    r = by_method[name]
    assert r["exact"] is True, r
    assert len(r["samples_us"]) == 3 and r["median_us"] > 0
  assert by_method["staged:cb:2x2"]["plan_phases_mean"] >= 1
  assert by_method["staged:cb:4x1"]["workspace_rows_allocated"] == 0
  # The custom call needs GPUs: recorded as a failure, not fatal.
  assert "GPUs only" in by_method["staged:cc:2x2"]["error"]
  md = (tmp_path / "dry.md").read_text()
  assert "| staged:cb:2x2 |" in md and "32 rows per GPU" in md

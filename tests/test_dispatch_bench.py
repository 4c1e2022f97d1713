"""benchmarks/dispatch_bench.py dry run on two CPU devices: the loop timing
with --consume=first_row lands every method and phase in the JSON and says
what the loop consumed in the markdown."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_loop_benchmark_dry_run_on_cpu(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.dispatch_bench", "--timing=loop", "--loop_unroll=2",
         "--consume=first_row", "--tokens=16", "--hidden=128",
         "--methods=max_counts,cap_and_spill:lax,ragged", "--phases=dispatch,dc",
         "--steps=4", "--routings=4", "--calibration_steps=20", f"--out={tmp_path}",
         "--tag=dry"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "dry.json").read_text())
    assert data["meta"]["consume"] == "first_row" and data["meta"]["timing"] == "loop"
    got = {(r["method"], r["phase"]) for r in data["results"]}
    assert {("max_counts", "dispatch"), ("max_counts", "dc"), ("ragged", "dc")} <= got
    assert any(method.startswith("cap_and_spill") and phase == "dc" for method, phase in got)
    assert all(r["mean_us"] > 0 for r in data["results"])
    md = (tmp_path / "dry.md").read_text()
    assert "`--consume=first_row`" in md and "| 16 | max_counts |" in md

"""benchmarks/async_ep_costs_gpu.py at tiny shapes on the CPU: the record it
writes and the routing-only simulation's cost envelopes read from it."""

import json
import os
import subprocess
import sys

import pytest

from moe_jax.async_ep import tokens as tk
from moe_jax.async_ep.costs import ProductionCosts, fine_buckets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "docs/benchmarks/experts/expert_ffn_1xH100.json")


def test_cost_record_on_cpu_feeds_the_simulation(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks/async_ep_costs_gpu.py"),
           "--hidden=64", "--ffn=128", "--heads=2", "--vocab=100", "--context=4",
           "--max_rows=10", "--iters=2", "--reps=1", f"--out={tmp_path}", "--tag=tiny"]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)
    with open(tmp_path / "tiny.json") as f:
        record = json.load(f)
    assert record["buckets"] == fine_buckets(10)
    for kind in ("attention", "expert", "sampler"):
        assert len(record[f"{kind}_s"]) == len(record["buckets"])
        assert all(v > 0 for v in record[f"{kind}_s"])
    meta = record["meta"]
    assert meta["shape"]["hidden"] == 64 and meta["command"].startswith(
        "python benchmarks/async_ep_costs_gpu.py") and meta["date"] and meta["commit"]
    assert (tmp_path / "tiny.md").read_text().startswith("# Layer costs")

    costs = ProductionCosts(RECORD, max_rows=10, gpu_costs=str(tmp_path / "tiny.json"))
    for kind in tk.KINDS:
        env_ = costs.of(kind)
        assert costs.model[kind].startswith("measured:")
        # the envelope never exceeds the measurement at a bucket, and is monotone
        for b, s in zip(record["buckets"], record[f"{kind}_s"]):
            assert env_(b) <= s + 1e-12
        vals = [env_(n) for n in range(1, 11)]
        assert all(a <= b for a, b in zip(vals, vals[1:]))
    with pytest.raises(ValueError, match="gpu_costs"):
        ProductionCosts(RECORD, max_rows=32, gpu_costs=str(tmp_path / "tiny.json"))

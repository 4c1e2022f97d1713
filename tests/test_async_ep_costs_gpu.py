"""benchmarks/async_ep_costs_gpu.py at tiny shapes on the CPU: the record it
writes (complete, and partial at a time budget) and the routing-only
simulation's cost envelopes read from it."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.async_ep_costs_gpu import coarse_to_fine, timed_buckets
from moe_jax.async_ep import tokens as tk
from moe_jax.async_ep.costs import ProductionCosts, fine_buckets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "docs/benchmarks/experts/expert_ffn_1xH100.json")
TINY = ["--hidden=64", "--ffn=128", "--heads=2", "--vocab=100", "--context=4", "--max_rows=40",
        "--iters=2", "--reps=1", "--run_s=0"]


def _run(tmp_path, *extra):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks/async_ep_costs_gpu.py"), *TINY,
           f"--out={tmp_path}", *extra]
    out = subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    return out.stdout


def test_timed_buckets_and_order():
    fine = fine_buckets(2048)
    coarse = timed_buckets(2048, 1.5)
    assert coarse[:4] == [1, 2, 4, 8] and coarse[-1] == 2048 and set(coarse) <= set(fine)
    assert len(coarse) < len(fine) / 2
    assert all(b >= 1.5 * a for a, b in zip(coarse[3:-2], coarse[4:-1]))
    assert timed_buckets(2048, 1.01) == [1, 2, 4] + fine[7:]
    assert timed_buckets(3, 1.5) == [1, 2, 3]
    for n in (1, 2, 3, 7, 17):
        order = coarse_to_fine(n)
        assert sorted(order) == list(range(n)) and order[:2] == [0, n - 1][:n]


def test_cost_record_on_cpu_feeds_the_simulation(tmp_path):
    _run(tmp_path, "--tag=tiny")
    with open(tmp_path / "tiny.json") as f:
        record = json.load(f)
    assert record["buckets"] == timed_buckets(40, 1.5)
    for kind in ("attention", "expert", "sampler"):
        assert len(record[f"{kind}_s"]) == len(record["buckets"])
        assert all(v > 0 for v in record[f"{kind}_s"])
    meta = record["meta"]
    assert meta["complete"] and meta["measured"] == len(record["buckets"])
    assert meta["shape"]["hidden"] == 64 and meta["command"].startswith(
        "python benchmarks/async_ep_costs_gpu.py") and meta["date"] and meta["commit"]
    text = (tmp_path / "tiny.md").read_text()
    assert text.startswith("# Layer costs") and "PARTIAL" not in text

    costs = ProductionCosts(RECORD, max_rows=40, gpu_costs=str(tmp_path / "tiny.json"))
    for kind in tk.KINDS:
        env_ = costs.of(kind)
        assert costs.model[kind].startswith("measured:") and "PARTIAL" not in costs.model[kind]
        # the envelope never exceeds the measurement at a bucket, and is monotone
        for b, s in zip(record["buckets"], record[f"{kind}_s"]):
            assert env_(b) <= s + 1e-12
        vals = [env_(n) for n in range(1, 41)]
        assert all(a <= b for a, b in zip(vals, vals[1:]))
    with pytest.raises(ValueError, match="gpu_costs"):
        ProductionCosts(RECORD, max_rows=64, gpu_costs=str(tmp_path / "tiny.json"))

    # a zero time budget: the first bucket is never started, the record says so
    _run(tmp_path, "--tag=none", "--time_budget_s=0")
    with open(tmp_path / "none.json") as f:
        empty = json.load(f)
    assert empty["buckets"] == [] and not empty["meta"]["complete"]
    assert "PARTIAL" in (tmp_path / "none.md").read_text()

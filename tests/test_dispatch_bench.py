"""benchmarks/dispatch_bench.py dry runs on two CPU devices: the loop timing
with --consume=first_row lands every method and phase in the JSON and says
what the loop consumed in the markdown; with --replicate every method runs on
a placement, the devices deliver every row, and the busiest rank receives no
more rows than without replication."""

import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks.summary import summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
LOG_LINE = re.compile(r"^[IWE]\d{4} |^WARNING: ")


def _run(*flags):
    return subprocess.run([sys.executable, "-m", "benchmarks.dispatch_bench", *flags],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)


def test_loop_benchmark_dry_run_on_cpu(tmp_path):
    proc = _run("--timing=loop", "--loop_unroll=2",
                "--consume=first_row", "--tokens=16", "--hidden=128",
                "--methods=max_counts,cap_and_spill:lax,ragged", "--phases=dispatch,dc",
                "--steps=4", "--routings=4", "--calibration_steps=20", f"--out={tmp_path}",
                "--tag=dry")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "dry.json").read_text())
    assert data["meta"]["consume"] == "first_row" and data["meta"]["timing"] == "loop"
    assert data["meta"]["replication"] is None
    got = {(r["method"], r["phase"]) for r in data["results"]}
    assert {("max_counts", "dispatch"), ("max_counts", "dc"), ("ragged", "dc")} <= got
    assert any(method.startswith("cap_and_spill") and phase == "dc" for method, phase in got)
    assert all(r["mean_us"] > 0 and r["placement"] is None for r in data["results"])
    md = (tmp_path / "dry.md").read_text()
    assert "`--consume=first_row`" in md and "| 16 | max_counts |" in md
    assert "replicat" not in md


TOKENS, TOP_K = 16, 2
SKEWED = ("--timing=loop", f"--tokens={TOKENS}", "--hidden=64", "--ffn=32", "--skew=2",
          "--methods=max_counts,cap_and_spill:lax,gshard", "--quantiles=0.99",
          "--phases=dc,layer", "--steps=4", "--routings=6", "--calibration_steps=40")


def _results(tmp_path, tag, *flags):
    proc = _run(*SKEWED, f"--out={tmp_path}", f"--tag={tag}", *flags)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / f"{tag}.json").read_text())
    assert not [r for r in data["results"] if "error" in r], data["results"]
    got = {(r["method"], r["phase"]) for r in data["results"]}
    assert {(m, p) for m in ("max_counts", "cap_and_spill:lax", "gshard")
            for p in ("dc", "layer")} <= got
    return data


def test_replicated_runs_deliver_every_row_and_level_the_busiest_rank(tmp_path):
    plain = _results(tmp_path, "plain")
    spread = _results(tmp_path, "spread", "--replicate=1", "--replica_choice=balanced",
                      "--spare_slots=4")
    local = _results(tmp_path, "local", "--replicate=3", "--replica_choice=local",
                     "--spare_slots=1")
    rows = lambda data: data["results"][0]["rows_per_rank"]          # noqa: E731
    busiest = lambda data: data["results"][0]["busiest_rank_rows"]   # noqa: E731
    for data in (plain, spread, local):
        # Every (token, pick) row reaches one rank: 2 ranks x T tokens x top-k.
        assert sum(rows(data)) == pytest.approx(2 * TOKENS * TOP_K)
        assert len({(r["tokens"], r["busiest_rank_rows"]) for r in data["results"]}) == 1
    # S = 4 + 4: every expert on both ranks, so the balanced rule splits the
    # rows evenly; the skewed routing leaves one rank busier without it.
    assert spread["meta"]["replication"]["slot_expert"] == [[0, 1, 2, 3, 4, 5, 6, 7],
                                                            [4, 5, 6, 7, 0, 1, 2, 3]]
    assert busiest(spread) == TOKENS * TOP_K < busiest(plain)
    assert busiest(local) <= busiest(plain)
    for data, label in ((spread, "balanced S=8"), (local, "local S=5")):
        meta = data["meta"]["replication"]
        assert meta["slots_per_rank"] == int(label[-1])
        assert all(r["placement"] == label for r in data["results"])
        # max_counts pads every peer to the worst case over the rank's S slots.
        assert {r["worst_case"] for r in data["results"]} == {TOKENS * TOP_K}
        cas = [r for r in data["results"] if r["method"] == "cap_and_spill:lax"]
        assert all(r["capacity"] >= 1 and r["spill_capacity"] >= 1 for r in cas)
    md = (tmp_path / "spread.md").read_text()
    assert "hot-expert replication on every row: balanced rule on Placement.spread" in md
    assert "| 16 | max_counts [replicated: balanced S=8] |" in md
    assert "skew 2 instead of its 0.675" in md
    # summary.py: one table set per run file, the replicated one says so.
    text = summarize([str(tmp_path / f"{t}.json") for t in ("plain", "spread")])
    sections = text.split("### ")[1:]
    assert len(sections) == 2
    assert sum("Hot-expert replication on every cell" in s for s in sections) == 1
    assert "Hot-expert replication" in next(s for s in sections if "spread.json" in s)


@pytest.mark.parametrize("flag", ["--replicate=-1", "--skew=-1"])
def test_bad_replication_flag_is_one_line(flag, tmp_path):
    proc = _run(f"--out={tmp_path}", flag)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line and not LOG_LINE.match(line)]
    assert len(lines) == 1 and ": error: " in lines[0] and flag in lines[0], proc.stderr

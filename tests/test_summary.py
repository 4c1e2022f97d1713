"""benchmarks/summary.py: every table comes from one run."""

import json

from benchmarks import summary


def _run(path, flags, base_us):
    """A dispatch_bench result file whose every cell is base_us + a small offset."""
    results = []
    for i, tokens in enumerate((16, 64)):
        for j, (method, q) in enumerate(summary.METHODS[:4]):
            results.append(dict(tokens=tokens, method=method, phase="dc", quantile=q,
                                mean_us=base_us + 10 * i + j, byte_floor_dc_us=1.0))
    machine_path = "/".join(["", "some", "machine", "path"])
    meta = dict(date="2026-11-25T00:00:00+00:00", command="python benchmarks/dispatch_bench.py "
                f"--timing=loop --out={machine_path}", devices="4 x NVIDIA H200",
                jax="0.11.2", hidden=4096, experts=8, top_k=2, steps=200, timing="loop",
                xla_flags=flags)
    path.write_text(json.dumps(dict(meta=meta, results=results)))
    return str(path)


def _tables(text):
    """[(heading, [cell values of the table rows])]."""
    out = []
    for block in text.split("### ")[1:]:
        heading = block.splitlines()[0]
        cells = []
        for line in block.splitlines():
            if line.startswith("| ") and not line.startswith("| T/GPU"):
                cells += [c.strip() for c in line.strip("|").split("|")[1:5]]
        out.append((heading, cells))
    return out


def test_runs_with_different_xla_flags_never_share_a_table(tmp_path):
    graphs = _run(tmp_path / "graphs.json", "--xla_gpu_enable_command_buffer=CUSTOM_CALL",
                  base_us=1000)
    plain = _run(tmp_path / "plain.json", "", base_us=2000)
    text = summary.summarize([graphs, plain])
    tables = _tables(text)
    assert len(tables) == 2
    for heading, cells in tables:
        values = {int(c) for c in cells if c.isdigit()}
        assert values, heading
        base = 1000 if "graphs.json" in heading else 2000
        assert all(base <= v < base + 100 for v in values), (heading, values)
    assert "--xla_gpu_enable_command_buffer=CUSTOM_CALL" in text
    assert "machine" not in text and "--out=OUT_DIR" in text


def test_ratios_compare_cells_of_one_run(tmp_path):
    """max_counts / cap_and_spill:lax is computed within the run."""
    text = summary.summarize([_run(tmp_path / "a.json", "", base_us=1000)])
    row = next(line for line in text.splitlines() if line.startswith("| 16 |"))
    assert "| 1.00x |" in row  # 1000 / 1001 rounds to 1.00x

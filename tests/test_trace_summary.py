"""benchmarks/trace_summary.py on a synthetic perfetto trace."""

import gzip
import json

import pytest

from benchmarks.trace_summary import device_span_us, device_time_by_kernel


def _write_trace(path, events):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:1"}},
            {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/host:CPU"}}]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_gpu0_kernels_only_per_step_and_span(tmp_path):
    path = tmp_path / "t.json.gz"
    _write_trace(path, [
        {"ph": "X", "pid": 1, "name": "gemm", "ts": 100.0, "dur": 30.0},
        {"ph": "X", "pid": 1, "name": "gemm", "ts": 140.0, "dur": 30.0},
        {"ph": "X", "pid": 1, "name": "pack", "ts": 175.0, "dur": 5.0},
        {"ph": "X", "pid": 2, "name": "gemm", "ts": 0.0, "dur": 999.0},   # another GPU
        {"ph": "X", "pid": 3, "name": "host", "ts": 0.0, "dur": 999.0},   # the host
    ])
    per_step = device_time_by_kernel(str(path), steps=2)
    assert dict(per_step) == {"gemm": pytest.approx(30.0), "pack": pytest.approx(2.5)}
    assert device_span_us(str(path)) == pytest.approx(80.0)


def test_no_gpu_kernels(tmp_path):
    path = tmp_path / "t.json.gz"
    _write_trace(path, [{"ph": "X", "pid": 3, "name": "host", "ts": 0.0, "dur": 5.0}])
    assert device_time_by_kernel(str(path), steps=1) == {}
    assert device_span_us(str(path)) == 0.0

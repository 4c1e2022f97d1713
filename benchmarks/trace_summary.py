"""Device time per kernel from a JAX profiler trace (perfetto JSON)."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import shutil
import tempfile
import time
from typing import Callable

import jax


def traced(run: Callable[[], None], copy_to: str) -> tuple[str | None, float]:
    """Runs `run()` under `jax.profiler.trace` and copies the trace to `copy_to`.

    Returns (copy_to, or None when no trace was written; wall seconds of run).
    """
    tmp = tempfile.mkdtemp()
    start = time.perf_counter()
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
        run()
    wall = time.perf_counter() - start
    traces = glob.glob(os.path.join(tmp, "**", "*.json.gz"), recursive=True)
    if not traces:
        return None, wall
    shutil.copy(traces[0], copy_to)
    return copy_to, wall


def write_summary(lines: list[str], path: str) -> None:
    """Prints the lines and writes them to path."""
    text = "\n".join(lines)
    print(text)
    with open(path, "w") as f:
        f.write(text + "\n")


def _gpu0_kernels(trace_path: str) -> list[dict]:
    with gzip.open(trace_path) as f:
        events = json.load(f)
    events = events.get("traceEvents", events)
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu0 = {pid for pid, n in names.items() if "GPU:0" in n or "gpu:0" in n.lower()}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu0]


def device_span_us(trace_path: str) -> float:
    """Microseconds from the first kernel's start to the last kernel's end on
    GPU 0 (0 when the trace has none)."""
    kernels = _gpu0_kernels(trace_path)
    if not kernels:
        return 0.0
    return (max(e["ts"] + e.get("dur", 0) for e in kernels) - min(e["ts"] for e in kernels))


def device_time_by_kernel(trace_path: str, steps: int) -> collections.Counter:
    """Microseconds per step by kernel name (first 90 characters) on GPU 0.

    Args:
      trace_path: a `*.trace.json.gz` written by `jax.profiler.trace(...,
        create_perfetto_trace=True)`.
      steps: the number of steps traced (the totals are divided by it).
    """
    per_kernel = collections.Counter()
    for e in _gpu0_kernels(trace_path):
        per_kernel[e["name"][:90]] += e.get("dur", 0) / steps
    return per_kernel

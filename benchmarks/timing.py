"""Host timing of jitted calls shared by the benchmarks."""

from __future__ import annotations

import statistics
import time

import jax


def median_seconds_per_call(fn, *args, reps: int, iters: int) -> float:
    """Median over `reps` runs of the seconds per call of `iters` back-to-back
    calls of fn(*args), each run timed on the host to the end of its last
    call (fn is called once first, so compilation is not timed)."""
    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - start) / iters)
    return statistics.median(runs)

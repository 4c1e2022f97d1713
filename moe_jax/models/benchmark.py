"""Timing of the jitted generation loop (compilation excluded).

:func:`time_generation` compiles a :class:`PreparedGeneration` ahead of time
(timed on its own), runs it ``warmup`` times (the first run's tokens and
counters are kept), then times ``runs`` further runs, each from the call to
the end of its outputs on the device (``jax.block_until_ready``). One run is
the whole generation: the prefill and every decode step, for the whole batch.

Per-token latency is a run's time divided by the new tokens per sequence
(prefill included, so it is the mean time between a sequence's tokens);
throughput is all new tokens of all sequences over the total time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from moe_jax.models.generate import GenerateResult, PreparedGeneration, collect

__all__ = ["GenerationTiming", "format_table", "time_generation"]


class GenerationTiming(NamedTuple):
    """compile_s: seconds to compile; run_s: [runs] float64 seconds of the
    timed runs; batch B and new_tokens T of one run; result: the
    GenerateResult of the first (warm-up) run."""

    compile_s: float
    run_s: np.ndarray
    batch: int
    new_tokens: int
    result: GenerateResult

    def summary(self) -> dict:
        """Plain numbers (JSON-ready): runs, compile_s, run_ms_mean,
        tokens_per_s, token_latency_ms_{mean,p50,p99}."""
        per_token_ms = self.run_s / self.new_tokens * 1e3
        return {
            "runs": int(self.run_s.size),
            "compile_s": float(self.compile_s),
            "run_ms_mean": float(np.mean(self.run_s) * 1e3),
            "tokens_per_s": float(self.batch * self.new_tokens * self.run_s.size
                                  / np.sum(self.run_s)),
            "token_latency_ms_mean": float(np.mean(per_token_ms)),
            "token_latency_ms_p50": float(np.percentile(per_token_ms, 50)),
            "token_latency_ms_p99": float(np.percentile(per_token_ms, 99)),
        }


def time_generation(prepared: PreparedGeneration, runs: int, warmup: int = 1,
                    on_run: Callable[[int], None] | None = None) -> GenerationTiming:
    """Compiles `prepared`, runs it `warmup` times, then times `runs` runs.

    Args:
      prepared: from :func:`moe_jax.models.generate.prepare_generation`,
        best without ``on_step`` (its per-step host callback would be timed
        too; the callback itself is not called here).
      runs: timed runs (>= 1).
      warmup: untimed runs after compiling (>= 1; the first gives `result`).
      on_run: called with the number of finished timed runs (progress).
    Under ``jax.distributed`` every process calls this; the runs proceed in
    lockstep (their collectives meet) and each process times its own.
    """
    if not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs: must be an integer >= 1, got {runs!r}")
    if not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup: must be an integer >= 1, got {warmup!r}")
    start = time.perf_counter()
    compiled = prepared.run.lower(*prepared.args).compile()
    compile_s = time.perf_counter() - start
    result = collect(prepared, compiled(*prepared.args))
    for _ in range(warmup - 1):
        jax.block_until_ready(compiled(*prepared.args))
    times = np.empty(runs, np.float64)
    for i in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*prepared.args))
        times[i] = time.perf_counter() - start
        if on_run is not None:
            on_run(i + 1)
    return GenerationTiming(compile_s, times, prepared.batch, prepared.max_new_tokens, result)


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A markdown table: one line per row, columns (header, key, format spec)."""
    head = "| " + " | ".join(h for h, _, _ in columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    body = ["| " + " | ".join(format(row[key], spec) if row.get(key) is not None else "-"
                              for _, key, spec in columns) + " |" for row in rows]
    return "\n".join([head, rule, *body])

"""Execution cost tables: seconds per layer execution by kind and bucket.

A table is measured once on the devices (`CostTable.measure`) and then
drives the simulated clocks of both engines, so that a comparison does not
depend on host noise during the run. Costs depend only on the layer kind and
the padded batch size (every block and every expert has the same shapes).
"""

from __future__ import annotations

import json
import math
import time
from typing import Mapping

import jax
import numpy as np

from moe_jax.async_ep import tokens as tk
from moe_jax.async_ep.model import LayerKernels, bucket_for
from moe_jax.async_ep.tokens import LayerId


class CostTable:
    """cost(layer, n) = seconds[layer.kind][bucket_for(n, max_batch)].

    Args:
      seconds: {kind: {bucket: seconds}} for every kind in tokens.KINDS and
        every bucket 1, 2, 4, ..., max_batch.
      max_batch: the largest bucket.
    """

    def __init__(self, seconds: Mapping[str, Mapping[int, float]], max_batch: int):
        self.max_batch = max_batch
        self.seconds = {kind: {int(b): float(s) for b, s in seconds[kind].items()}
                        for kind in tk.KINDS}
        buckets = sorted(self.seconds[tk.ATTENTION])
        for kind in tk.KINDS:
            if sorted(self.seconds[kind]) != buckets or buckets[-1] != max_batch:
                raise ValueError(f"seconds: {kind} must have the buckets 1..{max_batch}")

    def __call__(self, layer: LayerId, n: int) -> float:
        return self.seconds[layer.kind][bucket_for(n, self.max_batch)]

    def as_dict(self) -> dict[str, dict[int, float]]:
        return {kind: dict(table) for kind, table in self.seconds.items()}

    @staticmethod
    def model(fixed_s: float, row_s: float, max_batch: int) -> "CostTable":
        """fixed_s + row_s * bucket for every kind."""
        buckets = [1 << i for i in range(max_batch.bit_length())]
        return CostTable({kind: {b: fixed_s + row_s * b for b in buckets} for kind in tk.KINDS},
                         max_batch)

    @staticmethod
    def measure(kernels: LayerKernels, attention_devices, expert_devices, slots: int,
                rounds: int = 15, chain: int = 10) -> "CostTable":
        """Measures every kind at every bucket on the devices that run it.

        One round launches `chain` executions back to back (inputs already on
        the device) and blocks on the last; its time / chain is the cost of
        one execution as the device sees it (host dispatch overlaps device
        work, as it does in a serving loop). Per device the median over
        `rounds` rounds is taken, then the median over devices.
        """
        where = {tk.ATTENTION: attention_devices, tk.SAMPLER: attention_devices,
                 tk.EXPERT: expert_devices}
        seconds = {}
        for kind in tk.KINDS:
            seconds[kind] = {}
            for size in kernels.buckets:
                per_device = []
                for device in where[kind]:
                    step = kernels.timing_step(kind, device, size, slots)
                    jax.block_until_ready(step())
                    samples = []
                    for _ in range(rounds):
                        t0 = time.perf_counter()
                        for _ in range(chain):
                            out = step()
                        jax.block_until_ready(out)
                        samples.append((time.perf_counter() - t0) / chain)
                    per_device.append(float(np.median(samples)))
                seconds[kind][size] = float(np.median(per_device))
        return CostTable(seconds, kernels.max_batch)


# --- routing-only simulation: production-shape cost envelopes ----------------------------

def fine_buckets(max_rows: int, step: float = 1.125) -> list[int]:
    """Padded batch sizes 1..8, then geometric by `step` (rounded up to a
    multiple of 8), ending at max_rows: finer than powers of two."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    out = list(range(1, min(8, max_rows) + 1))
    b = 8.0
    while out[-1] < max_rows:
        b *= step
        nxt = min(max_rows, int(-(-math.ceil(b) // 8) * 8))
        if nxt > out[-1]:
            out.append(nxt)
    return out


class CostEnvelope:
    """Monotone cost of one execution by rows: cost(n) = min over buckets
    b >= n of seconds[b] (an execution of n rows may run padded to any larger
    bucket, so a dearer smaller bucket is never paid). Rows above the largest
    bucket run as several executions (the engines split them).

    Args:
      buckets: increasing padded sizes, the last one the largest batch.
      seconds: cost of one execution at each bucket.
    """

    def __init__(self, buckets, seconds):
        buckets = [int(b) for b in buckets]
        seconds = [float(s) for s in seconds]
        if not buckets or len(buckets) != len(seconds) or buckets != sorted(set(buckets)) \
                or buckets[0] < 1:
            raise ValueError("buckets: must be increasing ints >= 1, one cost each")
        self.buckets = buckets
        self.raw = seconds
        env = list(seconds)
        for i in range(len(env) - 2, -1, -1):
            env[i] = min(env[i], env[i + 1])
        self.seconds = env
        self.max_rows = buckets[-1]
        table = np.empty(self.max_rows + 1)
        table[0] = 0.0
        j = 0
        for n in range(1, self.max_rows + 1):
            while buckets[j] < n:
                j += 1
            table[n] = env[j]
        self._table = table

    def __call__(self, n: int) -> float:
        """Seconds for n rows (n > max_rows: full executions plus the rest)."""
        n = int(n)
        if n <= self.max_rows:
            return float(self._table[n])
        full, rest = divmod(n, self.max_rows)
        return full * float(self._table[self.max_rows]) + float(self._table[rest])

    def as_dict(self) -> dict:
        return {"buckets": self.buckets, "seconds": self.seconds}


def expert_costs_from_record(path: str, num_groups_key: str = "experts"):
    """Per-expert FFN seconds by rows from an `expert_ffn_bench` record.

    The record times the grouped SwiGLU FFN (CUTLASS kernel, bf16) of all E
    experts at R total rows; one expert with n rows is taken to cost
    cutlass_us(R = E n) / E (the grouped call streams every expert's weights
    once and splits the rows over the experts). Returns (rows_per_expert,
    seconds, meta) at the record's points; callers interpolate.
    """
    with open(path) as f:
        record = json.load(f)
    meta = record["meta"]
    groups = int(meta[num_groups_key])
    rows = [r["rows"] / groups for r in record["ffn"]]
    seconds = [r["cutlass_us"] * 1e-6 / groups for r in record["ffn"]]
    info = {"source": path, "device": meta.get("device"), "date": meta.get("date"),
            "commit": meta.get("commit"), "hidden": meta.get("hidden"), "ffn": meta.get("ffn"),
            "experts": groups, "kernel": "cutlass", "dtype": "bf16",
            "record_rows_total": [r["rows"] for r in record["ffn"]],
            "record_cutlass_us": [r["cutlass_us"] for r in record["ffn"]],
            "copy_gbps": record.get("floors", {}).get("copy_gbps"),
            "dense_tflops": record.get("floors", {}).get("dense_tflops")}
    return rows, seconds, info


def interpolate(xs, ys, x: float) -> float:
    """Piecewise-linear in x through the points; flat below the first point,
    extended with the last segment's slope above the last."""
    if x <= xs[0]:
        return float(ys[0])
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return float(ys[i - 1] + t * (ys[i] - ys[i - 1]))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(ys[-1] + slope * (x - xs[-1]))


class ProductionCosts:
    """Cost envelopes of the three layer kinds at production shapes.

    expert: interpolated from the recorded one-GPU CUTLASS measurement
      (`expert_costs_from_record`), MEASURED.
    attention and sampler: MODELLED unless `gpu_costs` names a record of
      `benchmarks/async_ep_costs_gpu.py` (then every kind comes from it,
      MEASURED per execution on one GPU): an MQA-like attention block (hidden H, H/128 query heads, one KV
      head of 128, bf16) streams its projection weights (q, o: H x H; k, v:
      H x 128; router H x E) and the KV cache of every row (ctx positions x
      2 x 128 x 2 bytes) at `bandwidth` bytes/s, plus `fixed_s` of launches;
      the sampler streams the LM head (H x vocab) plus `fixed_s`.
    """

    def __init__(self, record_path: str, max_rows: int = 2048, context: int = 160,
                 fixed_s: float = 15e-6, vocab: int = 32000, bandwidth: float | None = None,
                 step: float = 1.125, gpu_costs: str | None = None):
        xs, ys, info = expert_costs_from_record(record_path)
        self.source = info
        hidden = int(info["hidden"])
        bw = float(bandwidth or (info["copy_gbps"] or 2000.0) * 1e9)
        self.buckets = fine_buckets(max_rows, step)
        self.expert = CostEnvelope(self.buckets, [interpolate(xs, ys, b) for b in self.buckets])
        attn_weights = 2 * (2 * hidden * hidden + 2 * hidden * 128 + hidden * info["experts"])
        kv_per_row = context * 2 * 128 * 2
        self.attention = CostEnvelope(
            self.buckets, [fixed_s + (attn_weights + b * kv_per_row) / bw for b in self.buckets])
        self.sampler = CostEnvelope(
            self.buckets, [fixed_s + 2 * hidden * vocab / bw for _ in self.buckets])
        self.model = {"attention": f"modelled: {fixed_s * 1e6:.0f} us + ({attn_weights / 1e6:.1f} MB "
                                   f"weights + rows x {kv_per_row} B KV at ctx {context}) / "
                                   f"{bw / 1e9:.0f} GB/s",
                      "sampler": f"modelled: {fixed_s * 1e6:.0f} us + LM head {hidden}x{vocab} "
                                 f"bf16 / {bw / 1e9:.0f} GB/s",
                      "expert": f"measured: {info['source']} (CUTLASS, bf16, {info['device']}), "
                                f"per expert cutlass_us(E n) / E, interpolated linearly in rows"}
        if gpu_costs:
            self._use_gpu_costs(gpu_costs)

    def _use_gpu_costs(self, path: str):
        """Every kind from a `benchmarks/async_ep_costs_gpu.py` record (one GPU,
        one execution per timed bucket, a coarse subset of the buckets),
        interpolated linearly onto the buckets. A partial record (its run
        stopped at its time budget) is used as it is and named so in `model`."""
        with open(path) as f:
            record = json.load(f)
        meta = record["meta"]
        xs = [int(b) for b in record["buckets"]]
        if xs[-1] < self.buckets[-1]:
            raise ValueError(f"gpu_costs: {path} stops at {xs[-1]} rows, the envelopes need "
                             f"{self.buckets[-1]}")
        partial = ""
        if meta.get("complete") is False:
            partial = (f", PARTIAL record: {meta.get('measured')} of "
                       f"{len(meta.get('planned_buckets', []))} planned buckets")
        for kind in tk.KINDS:
            ys = [float(v) for v in record[f"{kind}_s"]]
            env = CostEnvelope(self.buckets, [interpolate(xs, ys, b) for b in self.buckets])
            setattr(self, {tk.ATTENTION: "attention", tk.EXPERT: "expert",
                           tk.SAMPLER: "sampler"}[kind], env)
            self.model[kind] = (f"measured: {path} ({meta['device']}, {meta['date']}, commit "
                                f"{meta['commit']}), shape {json.dumps(meta['shape'])}, "
                                f"{len(xs)} timed buckets interpolated{partial}")
        self.source = {**self.source, "gpu_costs": path, "gpu_costs_meta": meta}

    def of(self, kind: str) -> CostEnvelope:
        return {tk.ATTENTION: self.attention, tk.EXPERT: self.expert, tk.SAMPLER: self.sampler}[kind]

    def as_dict(self) -> dict:
        return {"source": self.source, "model": self.model, "buckets": self.buckets,
                "attention_s": self.attention.seconds, "expert_s": self.expert.seconds,
                "sampler_s": self.sampler.seconds}

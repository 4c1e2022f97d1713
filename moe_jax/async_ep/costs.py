"""Execution cost tables: seconds per layer execution by kind and bucket.

A table is measured once on the devices (`CostTable.measure`) and then
drives the simulated clocks of both engines, so that a comparison does not
depend on host noise during the run. Costs depend only on the layer kind and
the padded batch size (every block and every expert has the same shapes).
"""

from __future__ import annotations

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

"""Synchronous expert-parallel baseline on the same tiny model and kernels.

Every step all active requests advance one position together: for each
block, every rank runs attention on all its tokens, the tokens are routed,
every expert runs on all tokens routed to it (the all-to-all barrier), and
the outputs are combined in top-k order with `combine_topk`; then the
sampler runs. New requests join at step boundaries when a slot is free.
"""

from __future__ import annotations

import collections
import time
from typing import Sequence

import numpy as np

from moe_jax.async_ep import tokens as tk
from moe_jax.async_ep.dispatcher import Placement, devices_and_placement
from moe_jax.async_ep.executor import RunResult
from moe_jax.async_ep.model import LayerKernels, embed
from moe_jax.async_ep.pool import combine_topk
from moe_jax.async_ep.requests import Coordinator, Request


class SyncEngine:
    """Barrier-synchronous EP with the same placement and kernels as AsyncEngine."""

    def __init__(self, kernels: LayerKernels, num_devices: int = 2, num_ranks: int = 1,
                 slots_per_rank: int = 8, placement: Placement | None = None,
                 platform: str = "cpu"):
        self.kernels = kernels
        devices, self.placement = devices_and_placement(kernels.config, num_devices,
                                                        num_ranks, placement, platform)
        self.num_ranks = len(self.placement.rank_devices)
        self.slots_per_rank = slots_per_rank
        self.devices = devices

    def _chunks(self, n):
        m = self.kernels.max_batch
        return [slice(i, min(i + m, n)) for i in range(0, n, m)]

    def run(self, requests: Sequence[Request], max_steps: int = 100_000, timed: bool = False,
            latency_s: float = 0.0, cost=None) -> RunResult:
        """Runs until every request is done or `max_steps` steps.

        With timed=False arrivals are in steps. With timed=True they are in
        seconds of simulated time: devices overlap, so a phase (attention of a
        block, its experts, the sampler) lasts as long as its busiest device
        (measured wall time, or `cost(layer, n_rows)`), plus `latency_s` per
        barrier; tokens are stamped with the simulated end of their step.
        """
        k, c, pl = self.kernels, self.kernels.config, self.placement
        coordinator = Coordinator(self.num_ranks, self.slots_per_rank, c.max_len)
        caches = {r: k.new_cache(self.devices[d], self.slots_per_rank)
                  for r, d in enumerate(pl.rank_devices)}
        pending = sorted(requests, key=lambda r: r.arrival)
        waiting = collections.deque()
        active: dict[int, tuple[int, np.ndarray]] = {}   # request_id -> (position, x)
        start = time.perf_counter()
        executions, sizes, step, clock = 0, [], 0, 0.0
        busy = collections.Counter()
        device_busy = [0.0] * pl.num_devices

        def timed_call(dev_index, layer, n, fn, *args):
            out = fn(*args)
            spent = k.last_call_s if cost is None else cost(layer, n)
            busy[dev_index] += spent
            device_busy[dev_index] += spent
            return out

        def end_phase():
            nonlocal clock
            if busy:
                clock += max(busy.values()) + latency_s
            busy.clear()

        while step < max_steps:
            now = clock if timed else step
            while pending and pending[0].arrival <= now:
                waiting.append(pending.pop(0))
            while waiting:
                state = coordinator.admit(waiting[0], step)
                if state is None:
                    break
                req = waiting.popleft()
                active[req.request_id] = (0, embed(k.params, int(req.prompt[0]), 0))
            if not active:
                if not pending and not waiting:
                    break
                if timed:
                    clock = max(clock, pending[0].arrival) if pending else clock
                else:
                    step += 1
                continue
            by_rank = collections.defaultdict(list)
            for rid in active:
                by_rank[coordinator.states[rid].rank].append(rid)
            xs = {rid: x for rid, (_, x) in active.items()}
            for b in range(c.num_blocks):
                h, u, ids, w = {}, {}, {}, {}
                for r, rids in by_rank.items():
                    dev = self.devices[pl.rank_devices[r]]
                    for sl in self._chunks(len(rids)):
                        chunk = rids[sl]
                        out = timed_call(pl.rank_devices[r], tk.attention_layer(b, r), len(chunk),
                                         k.attention, dev, b, np.stack([xs[i] for i in chunk]),
                                          [active[i][0] for i in chunk],
                                          [coordinator.states[i].slot for i in chunk],
                                          caches[r][b], self.slots_per_rank)
                        caches[r][b] = out[4]
                        executions += 1
                        sizes.append(len(chunk))
                        for n, i in enumerate(chunk):
                            h[i], u[i], ids[i], w[i] = out[0][n], out[1][n], out[2][n], out[3][n]
                end_phase()
                # all-to-all: every expert runs on everything routed to it
                outs = {}
                for e in range(c.num_experts):
                    copies = [(i, j) for i in h for j in range(c.top_k) if ids[i][j] == e]
                    dev = self.devices[pl.expert_devices[e]]
                    for sl in self._chunks(len(copies)):
                        chunk = copies[sl]
                        y = timed_call(pl.expert_devices[e], tk.expert_layer(b, e), len(chunk),
                                       k.expert, dev, b, e, np.stack([u[i] for i, _ in chunk]))
                        executions += 1
                        sizes.append(len(chunk))
                        for n, key in enumerate(chunk):
                            outs[key] = y[n]
                end_phase()
                for i in h:
                    xs[i] = combine_topk(h[i], [outs[(i, j)] for j in range(c.top_k)],
                                         [float(w[i][j]) for j in range(c.top_k)])
            samples = []
            for r, rids in by_rank.items():
                dev = self.devices[pl.rank_devices[r]]
                for sl in self._chunks(len(rids)):
                    chunk = rids[sl]
                    sampled = timed_call(pl.rank_devices[r], tk.sampler_layer(c.num_blocks, r),
                                         len(chunk), k.sampler, dev,
                                         np.stack([xs[i] for i in chunk]))
                    executions += 1
                    sizes.append(len(chunk))
                    samples.extend(zip(chunk, sampled))
            end_phase()
            for i, token in samples:
                pos = active[i][0]
                nxt = coordinator.on_sampled(i, pos, int(token), clock if timed else step)
                if nxt is None:
                    del active[i]
                else:
                    active[i] = (pos + 1, embed(k.params, nxt, pos + 1))
            step += 1
        wall = time.perf_counter() - start
        states = coordinator.states
        return RunResult(
            outputs=coordinator.outputs(), ticks=step, finished=coordinator.all_done(requests),
            token_ticks={rid: list(s.token_times) for rid, s in states.items()},
            token_times={rid: (list(s.token_times) if timed else
                               [t - start for t in s.token_walls]) for rid, s in states.items()},
            arrivals={r.request_id: r.arrival for r in requests}, wall_s=wall,
            executions=executions, mean_batch=float(np.mean(sizes)) if sizes else 0.0,
            device_busy_s=device_busy if timed else None)

"""Per-device asynchronous executors and the simulation loop that drives them.

Each simulated device (a JAX CPU device) has a receptor, per-layer queues, a
token pool and a scheduler. The loop advances in ticks; in every tick

  1. arrived requests are admitted (first token to block-0 attention),
  2. messages due this tick are delivered to their device's receptor (the
     order may be shuffled and messages delayed, see `Delivery`),
  3. every device with a non-empty queue lets its scheduler pick one layer,
     drains up to `max_batch` tokens of it, runs the pre-compiled kernel at
     the bucketed size and hands the outputs to the dispatcher; outputs are
     due one tick later (plus any random delay).

Nothing waits at a barrier: a device runs whatever layer has tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import numpy as np

from moe_jax.async_ep import tokens as tk
from moe_jax.async_ep.dispatcher import (Dispatcher, Placement, as_batch,
                                         devices_and_placement)
from moe_jax.async_ep.model import LayerKernels
from moe_jax.async_ep.pool import Receptor, TokenPool
from moe_jax.async_ep.queues import LayerQueues
from moe_jax.async_ep.requests import Coordinator, Request
from moe_jax.async_ep.schedulers import Scheduler, SchedulerState
from moe_jax.async_ep.tokens import LayerId, Token


@dataclasses.dataclass(frozen=True)
class Delivery:
    """How the simulated network delivers messages.

    seed: None delivers in send order after exactly one tick; otherwise an
      RNG shuffles each tick's deliveries and delays each message by an extra
      0..max_delay ticks (uniform).
    """

    seed: int | None = None
    max_delay: int = 0


class DeviceExecutor:
    """One simulated device: queues, pool, receptor, scheduler, KV caches."""

    def __init__(self, index: int, device, placement: Placement, kernels: LayerKernels,
                 scheduler: Scheduler, coordinator: Coordinator, dispatcher: Dispatcher,
                 slots_per_rank: int):
        self.index = index
        self.device = device
        self.kernels = kernels
        self.scheduler = scheduler
        self.coordinator = coordinator
        self.dispatcher = dispatcher
        self.queues = LayerQueues(placement.layers_on(index))
        self.pool = TokenPool(kernels.config.top_k)
        self.receptor = Receptor(self.queues, self.pool)
        self.state = SchedulerState(placement.num_blocks)
        self.spare_slot = slots_per_rank
        self.caches = {r: kernels.new_cache(device, slots_per_rank)
                       for r, d in enumerate(placement.rank_devices) if d == index}
        self.executions = collections.Counter()   # LayerId -> batches run
        self.batch_sizes: list[int] = []

    def step(self, now, log=None) -> list[tuple[int, Token]]:
        """Runs at most one layer; returns the dispatched (device, token) pairs."""
        layer = self.scheduler.pick(self.queues.lengths(), self.state)
        if layer is None:
            return []
        batch = self.queues.pop(layer, self.kernels.max_batch)
        self.executions[layer] += 1
        self.batch_sizes.append(len(batch))
        if log is not None:
            log.extend((layer.kind, layer.block, t.request_id, t.position, t.part)
                       for t in batch)
        return self.execute(layer, batch, now)

    def execute(self, layer: LayerId, batch: Sequence[Token], now) -> list[tuple[int, Token]]:
        x, pos = as_batch(batch)
        if layer.kind == tk.ATTENTION:
            slots = [self.coordinator.states[t.request_id].slot for t in batch]
            cache = self.caches[layer.index][layer.block]
            h, u, ids, w, cache = self.kernels.attention(self.device, layer.block, x, pos,
                                                         slots, cache, self.spare_slot)
            self.caches[layer.index][layer.block] = cache
            return self.dispatcher.after_attention(layer, batch, h, u, ids, w)
        if layer.kind == tk.EXPERT:
            out = self.kernels.expert(self.device, layer.block, layer.index, x)
            return self.dispatcher.after_expert(layer, batch, out)
        sampled = self.kernels.sampler(self.device, x)
        return self.dispatcher.after_sampler(layer, batch, sampled, now)


@dataclasses.dataclass
class RunResult:
    """outputs: request_id -> generated token ids; ticks: ticks run; finished:
    whether every request completed; token_ticks / token_times: per request,
    the tick / wall time (s since start) of every generated token."""

    outputs: dict[int, list[int]]
    ticks: int
    finished: bool
    token_ticks: dict[int, list[float]]
    token_times: dict[int, list[float]]
    arrivals: dict[int, float]
    wall_s: float
    executions: int
    mean_batch: float
    log: list | None = None
    device_busy_s: list | None = None   # timed runs: simulated busy seconds per device


class AsyncEngine:
    """Asynchronous expert-parallel serving on simulated devices.

    Args:
      kernels: the model's LayerKernels (shared compiled functions).
      scheduler: a Scheduler instance (one shared policy object is fine: it
        is stateless), or a callable () -> Scheduler for one per device.
      num_devices: JAX CPU devices to use (<= len(jax.devices("cpu"))).
      num_ranks: attention DP ranks (devices 0..num_ranks-1).
      slots_per_rank: concurrent requests per rank.
      placement: overrides the colocated default placement.
      platform: JAX platform of the devices ("cpu" or "gpu").
    """

    def __init__(self, kernels: LayerKernels, scheduler, num_devices: int = 2,
                 num_ranks: int = 1, slots_per_rank: int = 8, placement: Placement | None = None,
                 platform: str = "cpu"):
        self.kernels = kernels
        self.devices, self.placement = devices_and_placement(
            kernels.config, num_devices, num_ranks, placement, platform)
        self.num_devices = num_devices
        self.num_ranks = len(self.placement.rank_devices)
        self.slots_per_rank = slots_per_rank
        self._scheduler = scheduler

    def _wire(self):
        """A fresh coordinator, dispatcher and one executor per device."""
        c = self.kernels.config
        coordinator = Coordinator(self.num_ranks, self.slots_per_rank, c.max_len)
        dispatcher = Dispatcher(self.placement, coordinator, self.kernels.params)
        sched = self._scheduler
        executors = [DeviceExecutor(i, d, self.placement, self.kernels,
                                    sched() if callable(sched) and not hasattr(sched, "pick")
                                    else sched, coordinator, dispatcher, self.slots_per_rank)
                     for i, d in enumerate(self.devices)]
        return coordinator, dispatcher, executors

    def run(self, requests: Sequence[Request], max_ticks: int = 100_000,
            delivery: Delivery = Delivery(), record_log: bool = False) -> RunResult:
        coordinator, dispatcher, executors = self._wire()
        rng = None if delivery.seed is None else np.random.default_rng(delivery.seed)
        pending = sorted(requests, key=lambda r: r.arrival)
        waiting: collections.deque = collections.deque()
        inbox: dict[int, list] = collections.defaultdict(list)   # due tick -> messages
        log = [] if record_log else None
        start = time.perf_counter()
        tick = 0
        while tick < max_ticks:
            while pending and pending[0].arrival <= tick:
                waiting.append(pending.pop(0))
            while waiting:
                state = coordinator.admit(waiting[0], tick)
                if state is None:
                    break
                waiting.popleft()
                inbox[tick].append(dispatcher.first_token(state.request.request_id,
                                                          state.rank, state.request.prompt))
            due = inbox.pop(tick, [])
            if rng is not None and due:
                due = [due[i] for i in rng.permutation(len(due))]
            by_device = collections.defaultdict(list)
            for dest, token in due:
                by_device[dest].append(token)
            for dest, toks in by_device.items():
                executors[dest].receptor.receive(toks)
            for ex in executors:
                for msg in ex.step(tick, log):
                    delay = 1 if rng is None else 1 + int(rng.integers(0, delivery.max_delay + 1))
                    inbox[tick + delay].append(msg)
            tick += 1
            if not pending and not waiting and not inbox and coordinator.all_done(requests) \
                    and all(len(ex.queues) == 0 and len(ex.pool) == 0 for ex in executors):
                break
        wall = time.perf_counter() - start
        finished = coordinator.all_done(requests)
        sizes = [s for ex in executors for s in ex.batch_sizes]
        self.last_executors = executors
        states = coordinator.states
        return RunResult(
            outputs=coordinator.outputs(), ticks=tick, finished=finished,
            token_ticks={rid: list(s.token_times) for rid, s in states.items()},
            token_times={rid: [w - start for w in s.token_walls] for rid, s in states.items()},
            arrivals={r.request_id: r.arrival for r in requests},
            wall_s=wall, executions=len(sizes),
            mean_batch=float(np.mean(sizes)) if sizes else 0.0, log=log)


class TimedAsyncEngine(AsyncEngine):
    """AsyncEngine on simulated time: every device has its own clock.

    The device whose next work is earliest runs next; a layer execution
    advances that device's clock by the measured wall time of its kernel
    call (padding, transfer, run, copy back; `LayerKernels.last_call_s`), or by
    `cost(layer, n_rows)` when given), and its outputs arrive `latency_s`
    later at another device, at once on the same device (the sampler's next
    token to block-0 attention, an expert's output to a colocated rank).
    Devices therefore overlap in simulated time as real ones would, while
    the host runs them one after another. Request arrivals are in
    seconds of simulated time.
    """

    def run_timed(self, requests: Sequence[Request], latency_s: float = 0.0,
                  max_executions: int = 1_000_000, cost=None) -> RunResult:
        import heapq
        coordinator, dispatcher, executors = self._wire()
        clocks = [0.0] * len(executors)
        busy = [0.0] * len(executors)
        inbox = [[] for _ in executors]     # per device heap of (time, seq, token)
        seq = 0
        pending = collections.deque(sorted(requests, key=lambda r: r.arrival))
        waiting: collections.deque = collections.deque()
        executions = 0
        start = time.perf_counter()

        def admit(now):
            nonlocal seq
            while pending and pending[0].arrival <= now:
                waiting.append(pending.popleft())
            while waiting:
                state = coordinator.admit(waiting[0], now)
                if state is None:
                    return
                waiting.popleft()
                dest, token = dispatcher.first_token(state.request.request_id, state.rank,
                                                     state.request.prompt)
                heapq.heappush(inbox[dest], (max(now, state.request.arrival), seq, token))
                seq += 1

        while executions < max_executions:
            ready = []
            for i, ex in enumerate(executors):
                if len(ex.queues):
                    ready.append((clocks[i], i))
                elif inbox[i]:
                    ready.append((max(clocks[i], inbox[i][0][0]), i))
            next_arrival = pending[0].arrival if pending else float("inf")
            if not ready and next_arrival == float("inf"):
                break
            now, i = min(ready) if ready else (next_arrival, -1)
            if next_arrival <= now:
                admit(next_arrival)
                continue
            admit(now)
            ex = executors[i]
            clocks[i] = now
            arrived = []
            while inbox[i] and inbox[i][0][0] <= now:
                arrived.append(heapq.heappop(inbox[i])[2])
            ex.receptor.receive(arrived)
            layer = ex.scheduler.pick(ex.queues.lengths(), ex.state)
            if layer is None:
                continue
            batch = ex.queues.pop(layer, self.kernels.max_batch)
            ex.executions[layer] += 1
            ex.batch_sizes.append(len(batch))
            before = {t.request_id: len(coordinator.states[t.request_id].token_times)
                      for t in batch} if layer.kind == tk.SAMPLER else {}
            out = ex.execute(layer, batch, now)
            spent = self.kernels.last_call_s if cost is None else cost(layer, len(batch))
            clocks[i] = now + spent
            busy[i] += spent
            for rid, n in before.items():   # stamp tokens with the end of the execution
                times = coordinator.states[rid].token_times
                times[n:] = [clocks[i]] * (len(times) - n)
            for dest, token in out:
                due = clocks[i] + (0.0 if dest == i else latency_s)
                heapq.heappush(inbox[dest], (due, seq, token))
                seq += 1
            executions += 1
        wall = time.perf_counter() - start
        self.last_executors = executors
        sizes = [s for ex in executors for s in ex.batch_sizes]
        states = coordinator.states
        return RunResult(
            outputs=coordinator.outputs(), ticks=executions,
            finished=coordinator.all_done(requests),
            token_ticks={rid: list(s.token_times) for rid, s in states.items()},
            token_times={rid: list(s.token_times) for rid, s in states.items()},
            arrivals={r.request_id: r.arrival for r in requests}, wall_s=wall,
            executions=len(sizes), mean_batch=float(np.mean(sizes)) if sizes else 0.0,
            device_busy_s=busy)

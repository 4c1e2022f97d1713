"""Routing-only simulation of asynchronous and synchronous EP decode serving.

No model math runs: a token is a request id, its route through the experts
of every block is drawn up front from a `TraceModel`, and every layer
execution costs what a cost envelope (`costs.ProductionCosts`) says for its
row count. That makes production shapes (16 blocks, thousands of requests,
hundreds to thousands of concurrent tokens) cheap enough to sweep on a CPU.

Engines (all on the same `routes`, requests and KV slots of one run):

* `run_sync`: the ideal barrier-synchronous engine. Every step all active
  requests advance one token: per block, attention on every rank (phase as
  long as the busiest device), an all-to-all, every expert on all rows routed
  to it (phase as long as the busiest device), an all-to-all; then the
  sampler. `replicate > 0`: the same engine with the hottest experts of each
  block replicated (EPLB-style, `moe_jax.replication.propose` on the
  block's expected load; the rows of a replicated expert split evenly over
  its replicas).
* `run_async`: per-device queues per hosted layer, a scheduler per device
  (`schedulers.py`; `HoldScheduler` through `pick_timed`), point-to-point
  messages `latency_s` apart (none on the same device), top-k parts merged
  before the next block's attention.

Decode only (prefill is left out, as in the AMoE evaluation); the attention
cost model takes a fixed context length.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from typing import Sequence

import numpy as np

from moe_jax.async_ep import tokens as tk
from moe_jax.async_ep.dispatcher import Placement
from moe_jax.async_ep.schedulers import SchedulerState

MODES = ("rotated", "permuted", "persistent")


@dataclasses.dataclass(frozen=True)
class TraceModel:
    """Per-block expert load: rank r of a block's load order gets a share
    proportional to exp(-skew * r / E); `mode` says which expert has rank r
    in block b: "rotated" (expert (r + b) % E: the hot expert moves by one
    per block), "permuted" (a random permutation per block, from `seed`) or
    "persistent" (expert r in every block). A token's top-k experts in a
    block are k distinct experts drawn without replacement with those
    probabilities (Gumbel top-k)."""

    num_experts: int
    num_blocks: int
    top_k: int = 1
    skew: float = 3.0
    mode: str = "rotated"
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, {self.num_experts}], got {self.top_k}")

    def permutations(self) -> np.ndarray:
        """[B, E]: perm[b, r] is the expert of load rank r in block b."""
        E, B = self.num_experts, self.num_blocks
        if self.mode == "rotated":
            return (np.arange(E)[None, :] + np.arange(B)[:, None]) % E
        if self.mode == "persistent":
            return np.tile(np.arange(E), (B, 1))
        rng = np.random.default_rng(self.seed + 7919)
        return np.stack([rng.permutation(E) for _ in range(B)])

    def shares(self) -> np.ndarray:
        """[B, E] probability of each expert in each block (rows sum to 1)."""
        base = np.exp(-self.skew * np.arange(self.num_experts) / self.num_experts)
        base /= base.sum()
        out = np.zeros((self.num_blocks, self.num_experts))
        perm = self.permutations()
        for b in range(self.num_blocks):
            out[b, perm[b]] = base
        return out

    def sample(self, num_tokens: int, seed: int) -> np.ndarray:
        """[num_tokens, B, k] int16 expert ids."""
        rng = np.random.default_rng(seed)
        logp = np.log(self.shares())[None]
        out = np.empty((num_tokens, self.num_blocks, self.top_k), np.int16)
        chunk = 8192
        for s in range(0, num_tokens, chunk):
            n = min(chunk, num_tokens - s)
            keys = logp + rng.gumbel(size=(n, self.num_blocks, self.num_experts))
            out[s:s + n] = np.argsort(-keys, axis=-1)[..., :self.top_k]
        return out


@dataclasses.dataclass(frozen=True)
class Workload:
    """num_requests decode requests; output lengths uniform in new_tokens
    (inclusive); arrivals Poisson at `rate` requests/s, or all at t = 0 when
    rate is None (the KV slots then bound the concurrency)."""

    num_requests: int = 2000
    new_tokens: tuple = (16, 48)
    rate: float | None = None
    seed: int = 0

    def requests(self) -> tuple[np.ndarray, np.ndarray]:
        """(arrival seconds [R], output tokens [R])."""
        rng = np.random.default_rng(self.seed)
        lo, hi = self.new_tokens
        lengths = rng.integers(lo, hi + 1, self.num_requests)
        if self.rate is None:
            arrivals = np.zeros(self.num_requests)
        else:
            arrivals = np.cumsum(rng.exponential(1.0 / self.rate, self.num_requests))
        return arrivals, lengths


@dataclasses.dataclass
class Setup:
    """Devices, layout and costs shared by the engines of one comparison.

    costs: an object with `.of(kind) -> CostEnvelope` (costs.ProductionCosts).
    layout: "colocated" (ranks on devices 0..R-1, expert e on e % D) or
      "disaggregated" (ranks on 0..R-1, expert e on R + e % (D - R)).
    num_ranks: attention DP ranks; total_slots is split evenly over them.
    """

    trace: TraceModel
    costs: object
    num_devices: int
    num_ranks: int
    total_slots: int
    layout: str = "colocated"
    latency_s: float = 10e-6

    def placement(self) -> Placement:
        return Placement.make(self.layout, self.num_devices, self.num_ranks,
                              self.trace.num_experts, self.trace.num_blocks)

    @property
    def slots_per_rank(self) -> int:
        return max(1, self.total_slots // self.num_ranks)


@dataclasses.dataclass
class SimResult:
    """token_rid / token_time: every generated token (request id, simulated
    second); admit_time [R]; busy: per device list of (start, seconds);
    route_counts [B, E]: expert visits the engine executed."""

    engine: str
    token_rid: np.ndarray
    token_time: np.ndarray
    admit_time: np.ndarray
    lengths: np.ndarray
    busy: list
    num_devices: int
    executions: int
    mean_batch: float
    route_counts: np.ndarray
    finished: bool
    end_time: float
    layout: str = "colocated"
    by_kind: dict = dataclasses.field(default_factory=dict)

    def kind_totals(self) -> dict:
        """{kind: (executions, rows, busy seconds)} over the whole run."""
        return {k: tuple(v) for k, v in self.by_kind.items()}


def make_routes(trace: TraceModel, lengths: np.ndarray, seed: int):
    """(routes [sum(lengths), B, k], offsets [R]): token p of request i uses
    routes[offsets[i] + p]."""
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return trace.sample(int(lengths.sum()), seed), offsets


class _Admission:
    """Most free slots first, lowest rank on ties (as requests.Coordinator)."""

    def __init__(self, num_ranks, slots_per_rank):
        self.free = [slots_per_rank] * num_ranks

    def rank(self):
        r = max(range(len(self.free)), key=lambda q: (self.free[q], -q))
        if self.free[r] == 0:
            return None
        self.free[r] -= 1
        return r


# ------------------------------------------------------------------------------------------
# synchronous engine


def replicated_holders(setup: Setup, replicate: int) -> list[np.ndarray]:
    """Per block [D, E] bool: which devices hold (a replica of) each expert.

    The home placement is the engine's (expert e on device e % D, one rank per
    device). With E % D == 0, `moe_jax.replication.propose` picks the replicas
    for the block's expected load (the trace model's shares: the fixed point
    of its EMA tracker) with one spare slot per device and `replicate`
    candidate experts; otherwise a greedy adds replicas of the `replicate`
    hottest experts on the least-loaded devices while the busiest device's
    expected load drops.
    """
    E, D = setup.trace.num_experts, setup.num_devices
    shares = setup.trace.shares() * setup.trace.top_k
    out = []
    home = np.array([e % D for e in range(E)])
    for b in range(setup.trace.num_blocks):
        holds = np.zeros((D, E), bool)
        holds[home, np.arange(E)] = True
        if replicate > 0 and E % D == 0 and D > 1:
            from moe_jax import replication  # noqa: PLC0415

            per = E // D
            logical = (np.arange(E) % D) * per + np.arange(E) // D   # home rank = e % D
            loads = np.empty(E)
            loads[logical] = shares[b]
            placement = replication.propose(loads, D, per + 1, num_replicated=replicate)
            local = placement.as_arrays()["local_slot"] >= 0          # [P, E logical]
            holds = local[:, logical]
        elif replicate > 0:
            for e in np.argsort(-shares[b], kind="stable")[:replicate]:
                while True:
                    n_rep = holds.sum(0)
                    dev_load = holds.astype(float) @ (shares[b] / n_rep)
                    cand = [d for d in np.argsort(dev_load, kind="stable") if not holds[d, e]]
                    if not cand:
                        break
                    trial = holds.copy()
                    trial[cand[0], e] = True
                    if (trial.astype(float) @ (shares[b] / trial.sum(0))).max() \
                            >= dev_load.max() - 1e-12:
                        break
                    holds = trial
        out.append(holds)
    return out


def run_sync(setup: Setup, arrivals, lengths, routes, offsets, replicate: int = 0,
             name: str | None = None) -> SimResult:
    """The ideal barrier-synchronous engine (see the module docstring). It
    always uses the colocated layout with one attention rank per device."""
    trace, costs = setup.trace, setup.costs
    B, E, K, D = trace.num_blocks, trace.num_experts, trace.top_k, setup.num_devices
    attn, expert, sampler = (costs.of(tk.ATTENTION), costs.of(tk.EXPERT), costs.of(tk.SAMPLER))
    ranks = D
    admission = _Admission(ranks, max(1, setup.total_slots // ranks))
    holders = replicated_holders(setup, replicate) if replicate else None
    home = np.array([e % D for e in range(E)])
    order = np.argsort(arrivals, kind="stable")
    R = len(arrivals)
    admit_time = np.full(R, np.nan)
    rank_of = np.full(R, -1)
    pos = np.zeros(R, np.int64)
    active: list[int] = []
    waiting: collections.deque = collections.deque()
    nxt = 0
    clock = 0.0
    tok_rid, tok_time = [], []
    busy = [[] for _ in range(D)]
    route_counts = np.zeros((B, E), np.int64)
    executions, rows_total = 0, 0
    by_kind = {kind: [0, 0, 0.0] for kind in tk.KINDS}

    def account(kind, n, seconds):
        by_kind[kind][0] += 1
        by_kind[kind][1] += n
        by_kind[kind][2] += seconds

    lat = setup.latency_s
    while True:
        while nxt < R and arrivals[order[nxt]] <= clock:
            waiting.append(int(order[nxt]))
            nxt += 1
        while waiting:
            r = admission.rank()
            if r is None:
                break
            rid = waiting.popleft()
            rank_of[rid] = r
            admit_time[rid] = clock
            active.append(rid)
        if not active:
            if nxt >= R:
                break
            clock = max(clock, float(arrivals[order[nxt]]))
            continue
        act = np.asarray(active)
        per_rank = np.bincount(rank_of[act], minlength=ranks)
        g = offsets[act] + pos[act]
        for b in range(B):
            # attention phase
            t = [attn(int(n)) for n in per_rank]
            for d in range(D):
                if t[d] > 0:
                    busy[d].append((clock, t[d]))
                    account(tk.ATTENTION, int(per_rank[d]), t[d])
            executions += int((per_rank > 0).sum())
            rows_total += int(per_rank.sum())
            clock += max(t) + lat
            # expert phase
            counts = np.bincount(routes[g, b].reshape(-1), minlength=E)
            route_counts[b] += counts
            dev_t = [0.0] * D
            for e in range(E):
                n = int(counts[e])
                if n == 0:
                    continue
                if holders is None:
                    dev_t[home[e]] += expert(n)
                    account(tk.EXPERT, n, expert(n))
                    executions += 1
                else:
                    devs = np.flatnonzero(holders[b][:, e])
                    q, rem = divmod(n, len(devs))
                    for j, d in enumerate(devs):
                        m = q + (1 if j < rem else 0)
                        if m:
                            dev_t[d] += expert(m)
                            account(tk.EXPERT, m, expert(m))
                            executions += 1
                rows_total += n
            for d in range(D):
                if dev_t[d] > 0:
                    busy[d].append((clock, dev_t[d]))
            clock += max(dev_t) + lat
        t = [sampler(int(n)) for n in per_rank]
        for d in range(D):
            if t[d] > 0:
                busy[d].append((clock, t[d]))
                account(tk.SAMPLER, int(per_rank[d]), t[d])
        executions += int((per_rank > 0).sum())
        rows_total += int(per_rank.sum())
        clock += max(t)
        tok_rid.append(act)
        tok_time.append(np.full(len(act), clock))
        pos[act] += 1
        still = []
        for rid in active:
            if pos[rid] >= lengths[rid]:
                admission.free[rank_of[rid]] += 1
            else:
                still.append(rid)
        active = still
    return SimResult(name or ("sync-repl" if replicate else "sync"),
                     np.concatenate(tok_rid), np.concatenate(tok_time), admit_time, lengths,
                     busy, D, executions, rows_total / max(executions, 1), route_counts,
                     bool((pos >= lengths).all()), clock, by_kind=by_kind)


# ------------------------------------------------------------------------------------------
# asynchronous engine

_DELIVER, _DONE, _WAKE, _START = 0, 1, 2, 3


class _Queue:
    """FIFO of (enqueue time, rids) chunks; `ng[g]`: queued rows of wave group g."""

    __slots__ = ("chunks", "n", "ng")

    def __init__(self, groups: int):
        self.chunks = collections.deque()   # [enqueue time, rids array]
        self.n = 0
        self.ng = np.zeros(groups, np.int64)

    def push(self, t, rids, group_of):
        self.chunks.append([t, rids])
        self.n += len(rids)
        self.ng += np.bincount(group_of[rids], minlength=len(self.ng))

    def oldest(self):
        return self.chunks[0][0]

    def head_group(self, group_of) -> int:
        """Wave group of the oldest queued row."""
        return int(group_of[self.chunks[0][1][0]])

    def oldest_of(self, g, group_of) -> float:
        for t, arr in self.chunks:
            if (group_of[arr] == g).any():
                return t
        raise ValueError(f"g: no row of group {g} queued")

    def head_of(self, g, group_of) -> int:
        """The oldest queued row of group g."""
        for _, arr in self.chunks:
            mine = np.flatnonzero(group_of[arr] == g)
            if len(mine):
                return int(arr[mine[0]])
        raise ValueError(f"g: no row of group {g} queued")

    def pop_group(self, g, m, group_of):
        """Up to m of the oldest rows of wave group g."""
        out, need, keep = [], m, collections.deque()
        while self.chunks:
            t, arr = self.chunks.popleft()
            if need:
                mine = group_of[arr] == g
                take = np.flatnonzero(mine)[:need]
                if len(take):
                    out.append(arr[take])
                    need -= len(take)
                    rest = np.ones(len(arr), bool)
                    rest[take] = False
                    arr = arr[rest]
            if len(arr):
                keep.append([t, arr])
        self.chunks = keep
        rids = out[0] if len(out) == 1 else np.concatenate(out)
        self.n -= len(rids)
        self.ng[g] -= len(rids)
        return rids

    def pop(self, m, group_of):
        out, need = [], m
        while need and self.chunks:
            t, arr = self.chunks[0]
            if len(arr) <= need:
                out.append(arr)
                need -= len(arr)
                self.chunks.popleft()
            else:
                out.append(arr[:need])
                self.chunks[0][1] = arr[need:]
                need = 0
        rids = out[0] if len(out) == 1 else np.concatenate(out)
        self.n -= len(rids)
        self.ng -= np.bincount(group_of[rids], minlength=len(self.ng))
        return rids


def run_async(setup: Setup, scheduler, arrivals, lengths, routes, offsets,
              wave_admission: bool = False, name: str | None = None,
              max_batch: int | None = None, wave_groups: int = 1,
              stagger_s: float = 0.0, separate_groups: bool = False,
              on_exec=None, phase_offsets: Sequence[float] | None = None) -> SimResult:
    """Asynchronous EP on `setup`'s layout with one `scheduler` policy object
    (stateless) on every device.

    wave_admission: a new request's first token waits for the next sampler
      output of its wave and joins that wave (at once when the wave has no
      token in flight).
    wave_groups: G; the KV slots of every rank are split into G wave groups
      (a new request takes the group of its rank with the most free slots),
      and a timed scheduler's view of what is still upstream of a queue
      (`incoming`) counts only the groups queued there, so each group moves
      as its own wave. G = 1: one wave per rank, every rank's tokens of a
      block awaited together.
    stagger_s: group g's first tokens start no earlier than g * stagger_s
      (seconds), so that the groups' waves begin apart in the pipeline.
    separate_groups: an execution takes rows of one wave group only (the
      group of the queue's oldest row), so groups never merge.
    phase_offsets: per wave group, the stages (blocks; the sampler is stage
      num_blocks) it is meant to trail group 0 (`phase_offsets()`); a timed
      scheduler then also gets, per entry, the group's progress in stages
      plus its offset (`pick_timed(phase=...)`: HoldScheduler with
      priority="phase" runs the group furthest behind its place first).
    on_exec: optional callable(start, seconds, device, layer, rids, group_of)
      called at every execution (for the diagnostics of where time goes).
    """
    trace, costs = setup.trace, setup.costs
    B, E, K = trace.num_blocks, trace.num_experts, trace.top_k
    G = int(wave_groups)
    separate = bool(separate_groups) and G > 1
    if G < 1:
        raise ValueError(f"wave_groups must be >= 1, got {wave_groups!r}")
    if not stagger_s >= 0:
        raise ValueError(f"stagger_s must be >= 0, got {stagger_s!r}")
    pl = setup.placement()
    D, ranks = pl.num_devices, len(pl.rank_devices)
    env = {kind: costs.of(kind) for kind in tk.KINDS}
    max_batch = max_batch or min(e.max_rows for e in env.values())
    layers = []
    for d in range(D):
        layers += pl.layers_on(d)
    lid_of = {layer: i for i, layer in enumerate(layers)}
    dev_of = [pl.device_of(layer) for layer in layers]
    hosted = [[lid_of[layer] for layer in pl.layers_on(d)] for d in range(D)]
    att = [[lid_of[tk.attention_layer(b, r)] for r in range(ranks)] for b in range(B)]
    exp = [[lid_of[tk.expert_layer(b, e)] for e in range(E)] for b in range(B)]
    samp = [lid_of[tk.sampler_layer(B, r)] for r in range(ranks)]
    nxt_layer = [[att[b + 1][r] if b + 1 < B else samp[r] for r in range(ranks)]
                 for b in range(B)]
    queues = [_Queue(G) for _ in layers]
    stage = [layer.block + (0.5 if layer.kind == tk.EXPERT else 0.0) for layer in layers]
    state = SchedulerState(B)
    timed = hasattr(scheduler, "pick_timed")
    cost_fn = lambda kind, n: env[kind](n)  # noqa: E731

    if phase_offsets is not None and len(phase_offsets) != G:
        raise ValueError(f"phase_offsets: one per wave group ({G}), got {phase_offsets!r}")
    R = len(arrivals)
    W = ranks * G                      # waves: w = r * G + g
    tstep = np.zeros(R, np.int64)      # steps (sampler outputs) a request's wave has made
    wave_step = np.zeros(W, np.int64)
    admission = _Admission(ranks, setup.slots_per_rank)
    wave_free = np.zeros(W, np.int64)
    for r in range(ranks):
        for g in range(G):
            wave_free[r * G + g] = setup.slots_per_rank // G + (g < setup.slots_per_rank % G)
    rank_of = np.full(R, -1)
    wave_of = np.zeros(R, np.int64)
    group_of = np.zeros(R, np.int64)
    pos = np.zeros(R, np.int64)
    parts_left = np.zeros(R, np.int64)
    admit_time = np.full(R, np.nan)
    order = np.argsort(arrivals, kind="stable")
    waiting: collections.deque = collections.deque()
    buffered = [[] for _ in range(W)]
    in_flight = [0] * W                # tokens of the wave in the pipeline (not buffered)
    start_pending = [False] * W
    att_phase = np.zeros((B, ranks, G))   # tokens queued/running at attention b of rank r
    exp_phase = np.zeros((B, ranks, G))   # tokens with expert parts of block b outstanding
    samp_phase = np.zeros((ranks, G))
    inflight_exp = np.zeros((len(layers), G))
    route_counts = np.zeros((B, E), np.int64)
    busy_until = [0.0] * D
    busy_log = [[] for _ in range(D)]
    wake_at = [math.inf] * D
    heap: list = []
    seq = 0
    tok_rid, tok_time = [], []
    executions, rows_total = 0, 0
    by_kind = {kind: [0, 0, 0.0] for kind in tk.KINDS}
    lat = setup.latency_s

    def push(t, kind, dev, lid, rids):
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, dev, lid, rids))
        seq += 1

    def enqueue(lid, t, rids):
        queues[lid].push(t, rids, group_of)

    def start_tokens(r, rids, now):
        """First/next tokens of rank r enter attention of block 0."""
        if len(rids):
            tstep[rids] = np.maximum(tstep[rids], wave_step[wave_of[rids]])
            enqueue(att[0][r], now, rids)
            np.add.at(att_phase[0, r], group_of[rids], 1)

    def admit(now):
        started = set()
        while waiting:
            r = admission.rank()
            if r is None:
                return started
            rid = waiting.popleft()
            g = int(np.argmax(wave_free[r * G:(r + 1) * G]))
            w = r * G + g
            wave_free[w] -= 1
            rank_of[rid], wave_of[rid], group_of[rid] = r, w, g
            admit_time[rid] = now
            early = now < g * stagger_s
            if (wave_admission and in_flight[w]) or early:
                buffered[w].append(rid)
                if early and not in_flight[w] and not start_pending[w]:
                    start_pending[w] = True
                    push(g * stagger_s, _START, pl.rank_devices[r], w, None)
            else:
                in_flight[w] += 1
                start_tokens(r, np.array([rid]), now)
                started.add(pl.rank_devices[r])
        return started

    def incoming(lid, only=None):
        """Rows of the groups queued at `lid` (or of group `only`) still
        upstream of it."""
        layer = layers[lid]
        if only is None:
            present = queues[lid].ng > 0
        else:
            present = np.arange(G) == only
        if layer.kind == tk.EXPERT:
            seen = route_counts[layer.block]
            tot = seen.sum()
            share = seen[layer.index] / tot if tot else 1.0 / E
            up = inflight_exp[lid] + att_phase[layer.block].sum(axis=0) * K * share
            return float(up[present].sum())
        if layer.kind == tk.SAMPLER:
            return float(exp_phase[B - 1, layer.index][present].sum())
        if layer.block == 0:
            return float(samp_phase[layer.index][present].sum())
        return float(exp_phase[layer.block - 1, layer.index][present].sum())

    def try_run(d, now):
        nonlocal executions, rows_total
        if busy_until[d] > now:
            return
        lengths_d = {layers[lid]: queues[lid].n for lid in hosted[d]}
        if timed and separate:
            heads = {lid: queues[lid].head_group(group_of) for lid in hosted[d] if queues[lid].n}
            entries = [(layers[lid], int(queues[lid].ng[g]), queues[lid].oldest_of(g, group_of),
                        incoming(lid, g)) for lid, g in heads.items()]
            if phase_offsets is not None and heads:
                # each group's place on the cycle of B + 1 stages, shifted by its
                # offset (equal for all when every group is where it should be),
                # as a signed distance from the groups' circular mean
                S = B + 1
                ang = np.array([((tstep[queues[lid].head_of(g, group_of)] * S + stage[lid]
                                  + phase_offsets[g]) % S) * 2 * math.pi / S
                                for lid, g in heads.items()])
                ref = math.atan2(np.sin(ang).mean(), np.cos(ang).mean())
                phase = list(np.round(np.angle(np.exp(1j * (ang - ref))) * S / (2 * math.pi), 6))
                layer, wake = scheduler.pick_timed(now, lengths_d, entries, cost_fn, state,
                                                   phase=phase)
            else:
                layer, wake = scheduler.pick_timed(now, lengths_d, entries, cost_fn, state)
        elif timed:
            entries = [(layers[lid], queues[lid].n, queues[lid].oldest(), incoming(lid))
                       for lid in hosted[d] if queues[lid].n]
            layer, wake = scheduler.pick_timed(now, lengths_d, entries, cost_fn, state)
        else:
            layer, wake = scheduler.pick(lengths_d, state), None
        if layer is None:
            if wake is not None and wake < wake_at[d]:
                wake_at[d] = wake
                push(wake, _WAKE, d, -1, None)
            return
        lid = lid_of[layer]
        if separate:
            rids = queues[lid].pop_group(queues[lid].head_group(group_of), max_batch, group_of)
        else:
            rids = queues[lid].pop(max_batch, group_of)
        spent = env[layer.kind](len(rids))
        busy_until[d] = now + spent
        busy_log[d].append((now, spent))
        executions += 1
        rows_total += len(rids)
        acc = by_kind[layer.kind]
        acc[0] += 1
        acc[1] += len(rids)
        acc[2] += spent
        if on_exec is not None:
            on_exec(now, spent, d, layer, rids, group_of)
        push(now + spent, _DONE, d, lid, rids)

    def done(d, lid, rids, now):
        layer = layers[lid]
        b = layer.block
        if layer.kind == tk.ATTENTION:
            r = layer.index
            grp_n = np.bincount(group_of[rids], minlength=G)
            att_phase[b, r] -= grp_n
            exp_phase[b, r] += grp_n
            parts_left[rids] = K
            picks = routes[offsets[rids] + pos[rids], b].reshape(-1).astype(np.int64)
            owners = np.repeat(rids, K)
            route_counts[b] += np.bincount(picks, minlength=E)
            srt = np.argsort(picks, kind="stable")
            picks, owners = picks[srt], owners[srt]
            bounds = np.flatnonzero(np.diff(picks)) + 1
            for grp_e, grp in zip(np.split(picks, bounds), np.split(owners, bounds)):
                tgt = exp[b][int(grp_e[0])]
                dest = dev_of[tgt]
                inflight_exp[tgt] += np.bincount(group_of[grp], minlength=G)
                push(now + (0.0 if dest == d else lat), _DELIVER, dest, tgt, grp)
        elif layer.kind == tk.EXPERT:
            rk = rank_of[rids]
            for r in np.unique(rk):
                grp = rids[rk == r]
                tgt = nxt_layer[b][int(r)]
                dest = dev_of[tgt]
                push(now + (0.0 if dest == d else lat), _DELIVER, dest, tgt, grp)
        else:
            r = layer.index
            samp_phase[r] -= np.bincount(group_of[rids], minlength=G)
            tstep[rids] += 1
            np.maximum.at(wave_step, wave_of[rids], tstep[rids])
            tok_rid.append(rids)
            tok_time.append(np.full(len(rids), now))
            pos[rids] += 1
            cont = rids[pos[rids] < lengths[rids]]
            ended = rids[pos[rids] >= lengths[rids]]
            for w in wave_of[ended]:
                in_flight[w] -= 1
                wave_free[w] += 1
            admission.free[r] += len(ended)
            started = admit(now) if len(ended) else set()
            new = []
            for g in np.unique(group_of[rids]):
                w = r * G + int(g)
                if buffered[w] and now >= g * stagger_s:
                    new += buffered[w]
                    in_flight[w] += len(buffered[w])
                    buffered[w] = []
            start_tokens(r, np.concatenate([cont, np.asarray(new, np.int64)])
                         if new else cont, now)
            for dd in started:
                if dd != d:
                    try_run(dd, now)

    def start_wave(w, now):
        """A staggered group's time has come: its buffered tokens start."""
        start_pending[w] = False
        if buffered[w] and not in_flight[w]:
            new, buffered[w] = buffered[w], []
            in_flight[w] += len(new)
            start_tokens(w // G, np.asarray(new, np.int64), now)

    def deliver(d, lid, rids, now):
        layer = layers[lid]
        if layer.kind == tk.EXPERT:
            inflight_exp[lid] -= np.bincount(group_of[rids], minlength=G)
            enqueue(lid, now, rids)
            return
        parts_left[rids] -= 1
        ready = rids[parts_left[rids] == 0]
        if len(ready):
            r = layer.index
            prev = B - 1 if layer.kind == tk.SAMPLER else layer.block - 1
            grp_n = np.bincount(group_of[ready], minlength=G)
            exp_phase[prev, r] -= grp_n
            if layer.kind == tk.SAMPLER:
                samp_phase[r] += grp_n
            else:
                att_phase[layer.block, r] += grp_n
            enqueue(lid, now, ready)

    nxt = 0
    now = 0.0
    while True:
        t_arr = float(arrivals[order[nxt]]) if nxt < R else math.inf
        t_ev = heap[0][0] if heap else math.inf
        if t_arr == math.inf and t_ev == math.inf:
            break
        if t_arr <= t_ev:
            now = t_arr
            while nxt < R and arrivals[order[nxt]] <= now:
                waiting.append(int(order[nxt]))
                nxt += 1
            for d in admit(now):
                try_run(d, now)
            continue
        now, _, kind, d, lid, rids = heapq.heappop(heap)
        if kind == _DELIVER:
            deliver(d, lid, rids, now)
            # deliveries due at the same time to the same device: take them all first
            while heap and heap[0][0] == now and heap[0][2] == _DELIVER and heap[0][3] == d:
                _, _, _, _, lid2, rids2 = heapq.heappop(heap)
                deliver(d, lid2, rids2, now)
            try_run(d, now)
        elif kind == _DONE:
            done(d, lid, rids, now)
            try_run(d, now)
        elif kind == _START:
            start_wave(lid, now)
            try_run(d, now)
        else:
            if wake_at[d] == now:
                wake_at[d] = math.inf
            try_run(d, now)
    end = max([now] + [b for b in busy_until])
    label = name or getattr(scheduler, "name", "async")
    return SimResult(label, np.concatenate(tok_rid) if tok_rid else np.zeros(0, np.int64),
                     np.concatenate(tok_time) if tok_time else np.zeros(0), admit_time,
                     lengths, busy_log, D, executions, rows_total / max(executions, 1),
                     route_counts, bool((pos >= lengths).all()), end, layout=setup.layout,
                     by_kind=by_kind)


def phase_offsets(setup: Setup, wave_groups: int) -> list[float]:
    """Stages each wave group should trail group 0 so that the groups meet
    the heavy experts on different devices: with the trace model's expected
    rows per expert (total_slots / G tokens per group), expert costs from
    the envelope and the setup's placement, the offsets (0 for group 0,
    whole stages of the B + 1 for the others) that minimize the busiest
    device's expert time summed over the groups at one stage, maximized
    over the stages; ties go to the smaller sum of squares over devices and
    stages, then to the offsets nearest to even spacing."""
    import itertools  # noqa: PLC0415

    G = int(wave_groups)
    if G <= 1:
        return [0.0] * max(G, 1)
    trace = setup.trace
    B, E, K = trace.num_blocks, trace.num_experts, trace.top_k
    pl = setup.placement()
    D = pl.num_devices
    expert = setup.costs.of(tk.EXPERT)
    rows = setup.total_slots / G * K * trace.shares()            # [B, E]
    load = np.zeros((B + 1, D))                                  # the sampler stage has none
    for b in range(B):
        for e in range(E):
            n = int(round(rows[b, e]))
            if n:
                load[b, pl.device_of(tk.expert_layer(b, e))] += expert(n)
    S = B + 1
    even = [g * S / G for g in range(G)]
    best, best_key = None, None
    for rest in itertools.product(range(S), repeat=G - 1):
        offs = (0,) + rest
        if len(set(offs)) < G:
            continue
        tot = sum(np.roll(load, o, axis=0) for o in offs)       # [t, d]: group g at t - o_g
        spread = sum(min(abs(o - v), S - abs(o - v)) for o, v in zip(sorted(offs), even))
        key = (round(float(tot.max()), 9), round(float((tot ** 2).sum()), 12), spread)
        if best_key is None or key < best_key:
            best, best_key = offs, key
    return [float(o) for o in best]


# ------------------------------------------------------------------------------------------
# metrics


def steady_window(result: SimResult, slots: int, warm_fraction: float = 0.1):
    """[t0, t1]: from the admission of request number min(slots + 10% of R,
    R / 2) (in admission order: the first wave and one tenth more have been
    replaced) to the last admission (after it the system drains)."""
    adm = np.sort(result.admit_time[~np.isnan(result.admit_time)])
    R = len(adm)
    i0 = min(slots + int(math.ceil(warm_fraction * R)), R // 2)
    return float(adm[i0]), float(adm[-1])


def stats(result: SimResult, slots: int) -> dict:
    """Throughput, ITL mean/p99 and device utilization over the steady window."""
    t0, t1 = steady_window(result, slots)
    rid, t = result.token_rid, result.token_time
    span = max(t1 - t0, 1e-12)
    inside = (t >= t0) & (t <= t1)
    order = np.lexsort((t, rid))
    rs, ts = rid[order], t[order]
    same = rs[1:] == rs[:-1]
    gaps_ok = same & (ts[:-1] >= t0) & (ts[1:] <= t1)
    gaps = (ts[1:] - ts[:-1])[gaps_ok]
    util = []
    for log in result.busy:
        tot = 0.0
        for s, dur in log:
            e = s + dur
            if e <= t0 or s >= t1:
                continue
            tot += min(e, t1) - max(s, t0)
        util.append(tot / span)
    return {"engine": result.engine, "layout": result.layout, "t0": t0, "t1": t1,
            "tokens_per_s": float(inside.sum() / span),
            "itl_mean_ms": float(gaps.mean() * 1e3) if len(gaps) else float("nan"),
            "itl_p99_ms": float(np.percentile(gaps, 99) * 1e3) if len(gaps) else float("nan"),
            "util": util, "util_max": float(max(util)), "util_mean": float(np.mean(util)),
            "executions": result.executions, "mean_batch": result.mean_batch,
            "finished": result.finished}


def route_digest(routes: np.ndarray, offsets, lengths) -> np.ndarray:
    """[B, E] expert visits of every generated token: what every engine of a
    run must execute."""
    B = routes.shape[1]
    E = int(routes.max()) + 1
    return np.stack([np.bincount(routes[:, b].reshape(-1), minlength=E) for b in range(B)])


def choose_attention_devices(costs, num_experts: int, top_k: int, concurrency: int,
                             shares: np.ndarray) -> int:
    """The paper's layout: the fewest attention devices A whose per-block
    attention time at `concurrency` rows, attention(concurrency / A), does
    not exceed the mean expert device's per-block time (one expert per
    device), i.e. A from the attention/expert cost ratio."""
    expert = costs.of(tk.EXPERT)
    attn = costs.of(tk.ATTENTION)
    mean_rows = concurrency * top_k * shares.mean(axis=0)   # [E]
    per_expert = float(np.mean([expert(max(1, int(round(n)))) for n in mean_rows]))
    for a in range(1, num_experts + 1):
        if attn(int(math.ceil(concurrency / a))) <= per_expert:
            return a
    return num_experts

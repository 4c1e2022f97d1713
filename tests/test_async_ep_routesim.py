"""Routing-only simulation (moe_jax.async_ep.routesim): invariants, the hold
scheduler's deadline and escalation, the cost envelope and the layouts."""

import json

import numpy as np
import pytest

from moe_jax.async_ep import routesim as rs
from moe_jax.async_ep import tokens as tk
from moe_jax.async_ep.costs import CostEnvelope, ProductionCosts, fine_buckets, interpolate
from moe_jax.async_ep.dispatcher import Placement
from moe_jax.async_ep.schedulers import HoldScheduler, SchedulerState, make_scheduler

RECORD = "docs/benchmarks/experts/expert_ffn_1xH100.json"


@pytest.fixture(scope="module")
def costs():
    return ProductionCosts(RECORD, max_rows=256)


def _workload(costs, mode="rotated", top_k=1, devices=4, layout="colocated", ranks=None,
              rate=None, n=60):
    trace = rs.TraceModel(4, 3, top_k, 3.0, mode, seed=1)
    setup = rs.Setup(trace, costs, devices, ranks or devices, 16, layout=layout)
    arr, ln = rs.Workload(n, (2, 6), rate, seed=2).requests()
    routes, off = rs.make_routes(trace, ln, 3)
    return setup, arr, ln, routes, off


ENGINES = [("sync", {}), ("sync", {"replicate": 1}), ("defrag", {}), ("mtfs", {}),
           ("flfs", {}), ("hold", {}), ("hold", {"idle_wait": False}),
           ("hold", {"whole_first": False}),
           ("hold", {"wave_groups": 2, "separate_groups": True, "stagger_s": 2e-3}),
           ("hold", {"wave_groups": 3}),
           ("hold", {"priority": "phase", "wave_groups": 2, "separate_groups": True,
                     "phase_offsets": [0.0, 2.0]})]
RUN_KEYS = ("wave_groups", "separate_groups", "stagger_s", "phase_offsets")


@pytest.mark.parametrize("mode", rs.MODES)
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("rate", [None, 2000.0])
def test_every_request_completes_on_the_same_routes(costs, mode, top_k, rate):
    setup, arr, ln, routes, off = _workload(costs, mode, top_k, rate=rate)
    digest = rs.route_digest(routes, off, ln)
    assert digest.sum() == ln.sum() * setup.trace.num_blocks * top_k
    for kind, kw in ENGINES:
        if kind == "sync":
            res = rs.run_sync(setup, arr, ln, routes, off, **kw)
        else:
            sched = make_scheduler(kind, **{k: v for k, v in kw.items() if k not in RUN_KEYS})
            res = rs.run_async(setup, sched, arr, ln, routes, off, wave_admission=(kind == "hold"),
                               **{k: v for k, v in kw.items() if k in RUN_KEYS})
        assert res.finished, (kind, kw)
        executions, rows, busy = zip(*res.by_kind.values())
        assert sum(executions) == res.executions and sum(rows) == pytest.approx(
            res.mean_batch * res.executions)
        assert (res.route_counts == digest).all(), (kind, kw)
        assert np.bincount(res.token_rid, minlength=len(ln)).tolist() == ln.tolist()
        # tokens of a request come in order, after its admission
        for rid in range(len(ln)):
            t = res.token_time[res.token_rid == rid]
            assert (np.diff(t) > 0).all() and t[0] > res.admit_time[rid]
        st = rs.stats(res, setup.total_slots)
        assert st["tokens_per_s"] > 0 and all(0 <= u <= 1 + 1e-9 for u in st["util"])


def test_disaggregated_paper_layout_runs(costs):
    setup, arr, ln, routes, off = _workload(costs, devices=6, layout="disaggregated", ranks=2)
    pl = setup.placement()
    assert pl.rank_devices == (0, 1) and pl.expert_devices == (2, 3, 4, 5)
    for kind in ("defrag", "hold"):
        res = rs.run_async(setup, make_scheduler(kind), arr, ln, routes, off)
        assert res.finished and (res.route_counts == rs.route_digest(routes, off, ln)).all()


def test_trace_model_modes():
    t = rs.TraceModel(8, 16, 1, 3.0, "rotated")
    sh = t.shares()
    assert np.allclose(sh.sum(1), 1) and (sh.argmax(1) == np.arange(16) % 8).all()
    assert (rs.TraceModel(8, 16, 1, 3.0, "persistent").shares().argmax(1) == 0).all()
    perm = rs.TraceModel(8, 16, 1, 3.0, "permuted", seed=5).permutations()
    assert all(sorted(p) == list(range(8)) for p in perm)
    routes = t.sample(20000, seed=0)
    freq = np.stack([np.bincount(routes[:, b, 0], minlength=8) for b in range(16)]) / 20000
    assert np.abs(freq - sh).max() < 0.02
    top2 = rs.TraceModel(8, 4, 2, 3.0, "rotated").sample(500, seed=1)
    assert (top2[..., 0] != top2[..., 1]).all()


def test_cost_envelope_is_monotone():
    env = CostEnvelope([1, 2, 4, 8], [5.0, 3.0, 4.0, 2.0])
    assert env.seconds == [2.0, 2.0, 2.0, 2.0]
    env = CostEnvelope([1, 2, 4, 8], [1.0, 3.0, 2.0, 5.0])
    assert [env(n) for n in range(1, 9)] == [1.0, 2.0, 2.0, 2.0, 5.0, 5.0, 5.0, 5.0]
    assert env(17) == 2 * 5.0 + 1.0
    with pytest.raises(ValueError):
        CostEnvelope([2, 1], [1.0, 1.0])
    b = fine_buckets(2048)
    assert b[:8] == list(range(1, 9)) and b[-1] == 2048 and b == sorted(set(b))
    assert all(x % 8 == 0 for x in b[8:])
    assert interpolate([1, 3], [10, 30], 0) == 10 and interpolate([1, 3], [10, 30], 2) == 20
    assert interpolate([1, 3], [10, 30], 5) == 50


def test_production_costs_from_the_record(costs):
    for kind in tk.KINDS:
        env = costs.of(kind)
        vals = [env(n) for n in range(1, env.max_rows + 1)]
        assert all(a <= b for a, b in zip(vals, vals[1:])), kind
    # 4 rows per expert = the record's 32 total rows over 8 experts
    with open(RECORD) as f:
        at32 = next(r["cutlass_us"] for r in json.load(f)["ffn"] if r["rows"] == 32)
    assert costs.expert(4) == pytest.approx(at32 * 1e-6 / 8, rel=1e-6)
    assert costs.source["source"] == RECORD and costs.source["dtype"] == "bf16"
    assert "modelled" in costs.model["attention"] and "measured" in costs.model["expert"]


def _entry(block, kind, index, n, oldest, incoming):
    return (tk.LayerId(block, kind, index), n, oldest, incoming)


def _flat(kind, n):
    return 1.0 + 0.001 * n     # fixed-cost dominated: splitting a wave costs ~2x


def test_hold_scheduler_holds_until_the_deadline():
    s = HoldScheduler(hold_s=1e-3, slack=0.05)
    state = SchedulerState(4)
    frag = _entry(1, tk.EXPERT, 0, 3, 0.0, 20)
    queues = {frag[0]: 3}
    layer, wake = s.pick_timed(0.0005, queues, [frag], _flat, state)
    assert layer is None and wake == pytest.approx(1e-3)
    layer, wake = s.pick_timed(0.001, queues, [frag], _flat, state)
    assert layer == frag[0] and wake is None
    # nothing incoming: not a fragment
    whole = _entry(1, tk.EXPERT, 0, 3, 0.0, 0)
    assert s.pick_timed(0.0, queues, [whole], _flat, state)[0] == frag[0]
    # linear costs: splitting is free, so nothing is held
    assert s.pick_timed(0.0, queues, [frag], lambda k, n: 1e-6 * n, state)[0] == frag[0]
    # the device has other work: the fragment waits, the whole queue runs
    other = _entry(2, tk.ATTENTION, 0, 1, 0.0, 0)
    q2 = {frag[0]: 3, other[0]: 1}
    assert s.pick_timed(0.0, q2, [frag, other], _flat, state)[0] == other[0]
    # work-conserving variant: an idle device runs the fragment
    s2 = HoldScheduler(hold_s=1e-3, slack=0.05, idle_wait=False)
    assert s2.pick_timed(0.0, queues, [frag], _flat, state)[0] == frag[0]


def test_hold_scheduler_escalates_after_30ms():
    s = HoldScheduler(hold_s=1.0)
    state = SchedulerState(4)
    big = _entry(0, tk.ATTENTION, 0, 50, 0.020, 0)
    old = _entry(3, tk.EXPERT, 1, 1, 0.0, 100)
    queues = {big[0]: 50, old[0]: 1}
    assert s.pick_timed(0.029, queues, [big, old], _flat, state)[0] == big[0]
    assert s.pick_timed(0.030, queues, [big, old], _flat, state)[0] == old[0]


def test_hold_lookahead_is_capped_at_stages_minus_one():
    q = {tk.attention_layer(0, 0): 2, tk.sampler_layer(1, 0): 5}
    capped = HoldScheduler(lookahead=7, decay=1.0).scores(q, SchedulerState(1))
    one = make_scheduler("defrag", lookahead=1, decay=1.0).scores(q, SchedulerState(1))
    assert capped == one
    with pytest.raises(ValueError):
        HoldScheduler(escalate_s=0)


def test_paper_layout_attention_devices(costs):
    shares = rs.TraceModel(8, 16, 1, 3.0).shares()
    a = rs.choose_attention_devices(costs, 8, 1, 256, shares)
    assert a >= 1
    pl = Placement.disaggregated(a + 8, a, 8, 16)
    assert len(set(pl.expert_devices)) == 8 and not set(pl.expert_devices) & set(pl.rank_devices)

    class Heavy:   # attention 4x an expert: more attention devices
        def of(self, kind):
            return costs.expert if kind != tk.ATTENTION else CostEnvelope([256], [4 * costs.expert(256)])
    assert rs.choose_attention_devices(Heavy(), 8, 1, 256, shares) > a


def test_replicated_holders_split_the_hot_expert(costs):
    trace = rs.TraceModel(8, 4, 1, 3.0, "rotated")
    setup = rs.Setup(trace, costs, 8, 8, 64)
    holders = rs.replicated_holders(setup, 1)
    for b, h in enumerate(holders):
        assert h[b % 8, b % 8] and h[:, b % 8].sum() >= 2     # hot expert replicated
        assert (h.sum(0) >= 1).all()
    setup4 = rs.Setup(rs.TraceModel(8, 2, 2, 3.0, "persistent"), costs, 4, 4, 64)
    h = rs.replicated_holders(setup4, 1)[0]
    assert h[0, 0] and h[0, 4] and h[:, 0].sum() >= 2


def test_wave_groups_start_staggered(costs):
    setup, arr, ln, routes, off = _workload(costs, n=80)
    res = rs.run_async(setup, HoldScheduler(), arr, ln, routes, off, wave_admission=True,
                       wave_groups=2, separate_groups=True, stagger_s=1.0)
    assert res.finished and (res.route_counts == rs.route_digest(routes, off, ln)).all()
    first = np.array([res.token_time[res.token_rid == rid].min() for rid in range(len(ln))])
    at_zero = res.admit_time == 0.0
    # 16 slots over 4 ranks, 2 per rank and group: 8 requests of group 1 wait for t = 1 s
    assert at_zero.sum() == 16 and (first[at_zero] > 1.0).sum() == 8
    one = rs.run_async(setup, HoldScheduler(), arr, ln, routes, off, wave_admission=True)
    # two groups that never share an execution run at least as many as one wave
    assert res.executions >= one.executions
    with pytest.raises(ValueError, match="wave_groups"):
        rs.run_async(setup, HoldScheduler(), arr, ln, routes, off, wave_groups=0)
    with pytest.raises(ValueError, match="stagger_s"):
        rs.run_async(setup, HoldScheduler(), arr, ln, routes, off, stagger_s=-1.0)


def test_queue_pops_one_group_in_arrival_order():
    group_of = np.array([0, 1, 0, 1, 0, 0])
    q = rs._Queue(2)
    q.push(0.0, np.array([0, 1, 2]), group_of)
    q.push(1.0, np.array([3, 4, 5]), group_of)
    assert q.ng.tolist() == [4, 2] and q.head_group(group_of) == 0
    assert q.oldest_of(1, group_of) == 0.0
    assert q.pop_group(0, 3, group_of).tolist() == [0, 2, 4]
    assert q.n == 3 and q.ng.tolist() == [1, 2]
    assert q.pop_group(1, 5, group_of).tolist() == [1, 3]
    assert q.head_group(group_of) == 0 and q.pop(9, group_of).tolist() == [5]
    assert q.n == 0 and q.ng.tolist() == [0, 0]


def test_hold_releases_at_its_deadline_despite_rounding():
    s = HoldScheduler(hold_s=1e-3, slack=0.0)
    state = SchedulerState(4)
    # oldest + hold_s - oldest < hold_s in floating point for this oldest
    oldest = next(t for t in np.linspace(0.01, 1.0, 997) if (t + 1e-3) - t < 1e-3)
    frag = _entry(1, tk.EXPERT, 0, 3, oldest, 20)
    layer, wake = s.pick_timed(oldest + 1e-3, {frag[0]: 3}, [frag], _flat, state)
    assert layer == frag[0] and wake is None


def test_hold_runs_whole_queues_before_cheap_fragments():
    state = SchedulerState(4)
    linear = lambda kind, n: 1e-6 * n  # noqa: E731  (splitting is free: never held)
    frag = _entry(1, tk.EXPERT, 0, 30, 0.0, 20)
    whole = _entry(2, tk.ATTENTION, 0, 1, 0.0, 0)
    queues = {frag[0]: 30, whole[0]: 1}
    assert HoldScheduler().pick_timed(0.0, queues, [frag, whole], linear, state)[0] == whole[0]
    assert HoldScheduler(whole_first=False, priority="score").pick_timed(
        0.0, queues, [frag, whole], linear, state)[0] == frag[0]
    # alone, the cheap fragment runs
    assert HoldScheduler().pick_timed(0.0, {frag[0]: 30}, [frag], linear, state)[0] == frag[0]


def test_hold_priority_shortest_execution_first():
    state = SchedulerState(8)
    big = _entry(1, tk.EXPERT, 0, 300, 0.0, 0)
    small = _entry(5, tk.EXPERT, 1, 10, 0.0, 0)
    queues = {big[0]: 300, small[0]: 10}
    assert HoldScheduler().pick_timed(0.0, queues, [big, small], _flat, state)[0] == small[0]
    # the defrag score prefers the longer queue
    assert HoldScheduler(priority="score").pick_timed(
        0.0, queues, [big, small], _flat, state)[0] == big[0]
    with pytest.raises(ValueError, match="priority"):
        HoldScheduler(priority="longest")


def test_hold_priority_phase_runs_the_group_furthest_behind():
    state = SchedulerState(8)
    big = _entry(1, tk.EXPERT, 0, 300, 0.0, 0)
    small = _entry(5, tk.EXPERT, 1, 10, 0.0, 0)
    queues = {big[0]: 300, small[0]: 10}
    s = HoldScheduler(priority="phase")
    # the big queue's group is two stages behind its place: it goes first
    assert s.pick_timed(0.0, queues, [big, small], _flat, state, phase=[-1.0, 1.0])[0] == big[0]
    # within the band (one stage) the groups are level: cheapest first
    assert s.pick_timed(0.0, queues, [big, small], _flat, state, phase=[-0.2, 0.2])[0] == small[0]
    assert HoldScheduler(priority="phase", phase_band=0).pick_timed(
        0.0, queues, [big, small], _flat, state, phase=[-0.2, 0.2])[0] == big[0]
    # without phases it is the cheapest execution first
    assert s.pick_timed(0.0, queues, [big, small], _flat, state)[0] == small[0]
    with pytest.raises(ValueError, match="phase_band"):
        HoldScheduler(phase_band=-1)


def test_phase_offsets_put_the_rotated_hot_expert_on_other_devices(costs):
    # T2's shape: 8 devices, one expert each, hot expert rotated per block
    trace = rs.TraceModel(8, 16, 1, 3.0, "rotated")
    setup = rs.Setup(trace, costs, 8, 8, 2048)
    assert rs.phase_offsets(setup, 1) == [0.0]
    for G in (2, 3, 4):
        offs = rs.phase_offsets(setup, G)
        assert offs[0] == 0.0 and len(set(offs)) == G
        # no two groups at blocks whose hot expert sits on the same device
        hot = {int(o) % 8 for o in offs}
        assert len(hot) == G, offs
    setup1, arr, ln, routes, off = _workload(costs)
    with pytest.raises(ValueError, match="phase_offsets"):
        rs.run_async(setup1, HoldScheduler(), arr, ln, routes, off, wave_groups=2,
                     phase_offsets=[0.0])

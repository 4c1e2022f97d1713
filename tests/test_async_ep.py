"""Asynchronous expert parallelism: pool, queues, schedulers, executor vs. sync EP."""

import collections
import itertools

import jax
import numpy as np
import pytest
from hypothesis import given, strategies as st

from moe_jax.async_ep import tokens as tk
from moe_jax.async_ep.baseline import SyncEngine
from moe_jax.async_ep.executor import AsyncEngine, Delivery
from moe_jax.async_ep.model import LayerKernels, TinyMoEConfig, bucket_for, init_params
from moe_jax.async_ep.pool import Receptor, TokenPool, combine_topk
from moe_jax.async_ep.queues import LayerQueues
from moe_jax.async_ep.requests import Request
from moe_jax.async_ep.schedulers import (DefragScheduler, FirstLayerFirst, MostTokensFirst,
                                         SchedulerState, make_scheduler)
from moe_jax.async_ep.tokens import Token

from async_ep_testing import (assert_rows_independent_of_count, async_and_sync_outputs,
                              kernel_rows_by_count, random_requests)

CONFIG = TinyMoEConfig(vocab=64, hidden=16, ffn=32, heads=2, num_blocks=2, num_experts=4,
                       top_k=2, max_len=16)
NUM_DEVICES, NUM_RANKS, SLOTS = 4, 2, 4
SCHEDULERS = ("defrag", "hold", "mtfs", "flfs")


@pytest.fixture(scope="module")
def kernels():
    return LayerKernels(CONFIG, init_params(jax.random.PRNGKey(0), CONFIG), max_batch=8)


def make_requests(num, seed, arrivals=None):
    return random_requests(num, CONFIG.vocab, seed, arrivals=arrivals)


_SYNC_CACHE = {}


def sync_outputs(kernels, requests):
    key = tuple((r.request_id, tuple(r.prompt), r.max_new_tokens) for r in requests)
    if key not in _SYNC_CACHE:
        # Outputs do not depend on arrival times: each request is computed alone.
        result = SyncEngine(kernels, NUM_DEVICES, NUM_RANKS, SLOTS).run(requests)
        assert result.finished
        _SYNC_CACHE[key] = result.outputs
    return _SYNC_CACHE[key]


# ---------------------------------------------------------------- pool & queues

def _part(j, data, weight=0.0, layer=tk.attention_layer(1, 0)):
    return Token(7, 3, 0, layer, np.asarray(data, np.float32), part=j, weight=weight)


@given(st.permutations(range(-1, 3)), st.integers(0, 2**31 - 1))
def test_pool_merge_is_order_independent_and_equals_combine(order, seed):
    rng = np.random.default_rng(seed)
    data = {j: rng.normal(size=8).astype(np.float32) for j in range(-1, 3)}
    weights = rng.dirichlet(np.ones(3)).astype(np.float32)
    pool = TokenPool(top_k=3)
    results = [pool.add(_part(j, data[j], weights[j] if j >= 0 else 0.0)) for j in order]
    assert all(r is None for r in results[:-1])
    merged = results[-1]
    assert merged.part is None and merged.key == (7, 3, tk.attention_layer(1, 0))
    expected = data[-1] + weights[0] * data[0] + weights[1] * data[1] + weights[2] * data[2]
    np.testing.assert_array_equal(merged.data, expected.astype(np.float32))
    np.testing.assert_array_equal(merged.data, combine_topk(data[-1], [data[j] for j in range(3)],
                                                            list(weights)))
    assert len(pool) == 0


def test_pool_rejects_duplicates_and_bad_parts():
    pool = TokenPool(top_k=2)
    pool.add(_part(0, np.zeros(4)))
    with pytest.raises(ValueError, match="duplicate"):
        pool.add(_part(0, np.zeros(4)))
    with pytest.raises(ValueError, match="part"):
        pool.add(_part(2, np.zeros(4)))
    with pytest.raises(ValueError, match="top_k"):
        TokenPool(top_k=0)


def test_queues_fifo_and_receptor():
    layers = [tk.attention_layer(1, 0), tk.expert_layer(0, 1)]
    queues = LayerQueues(layers)
    receptor = Receptor(queues, TokenPool(top_k=1))
    copy = Token(1, 0, 0, tk.expert_layer(0, 1), np.zeros(2, np.float32), part=0, weight=1.0)
    assert receptor.receive([copy, _part(-1, np.zeros(2))]) == 1   # copy is ready at once
    assert receptor.receive([_part(0, np.ones(2), 1.0)]) == 1       # merge completes
    assert queues.lengths() == {layers[0]: 1, layers[1]: 1}
    for i in range(3):
        queues.push(Token(10 + i, 0, 0, layers[1], np.zeros(2, np.float32)))
    assert [t.request_id for t in queues.pop(layers[1], 3)] == [1, 10, 11]
    with pytest.raises(ValueError, match="token"):
        queues.push(Token(0, 0, 0, tk.expert_layer(5, 5), np.zeros(2)))
    with pytest.raises(ValueError, match="max_tokens"):
        queues.pop(layers[1], 0)


# ---------------------------------------------------------------- schedulers

def _reference_defrag(queues, num_blocks, lookahead, decay):
    stages = num_blocks + 1
    best, best_score = None, -1.0
    for layer in sorted(queues, key=lambda l: (l.order(), l.index)):
        if queues[layer] == 0:
            continue
        score = queues[layer]
        for k in range(1, lookahead + 1):
            b = (layer.block + k) % stages
            at = [n for l, n in queues.items() if l.block == b]
            score += (sum(at) / len(at) if at else 0.0) * decay ** k
        score = round(score, 9)
        if score > best_score:
            best, best_score = layer, score
    return best


@given(st.lists(st.integers(0, 6), min_size=9, max_size=9), st.integers(0, 8),
       st.sampled_from([0.5, 0.8, 1.0]))
def test_defrag_matches_reference(lengths, lookahead, decay):
    layers = [tk.attention_layer(b, 0) for b in range(3)] + \
             [tk.expert_layer(b, e) for b in range(3) for e in (0, 2)]
    layers = layers[:8] + [tk.sampler_layer(3, 0)]
    queues = dict(zip(layers, lengths))
    got = DefragScheduler(lookahead, decay).pick(queues, SchedulerState(3))
    assert got == _reference_defrag(queues, 3, lookahead, decay)


def test_baseline_schedulers():
    state = SchedulerState(2)
    queues = {tk.attention_layer(0, 0): 1, tk.expert_layer(0, 1): 5,
              tk.attention_layer(1, 0): 5, tk.sampler_layer(2, 0): 0}
    assert FirstLayerFirst().pick(queues, state) == tk.attention_layer(0, 0)
    assert MostTokensFirst().pick(queues, state) == tk.expert_layer(0, 1)  # earlier on ties
    empty = {layer: 0 for layer in queues}
    for s in (FirstLayerFirst(), MostTokensFirst(), DefragScheduler()):
        assert s.pick(empty, state) is None
    d = DefragScheduler()
    assert (d.lookahead, d.decay) == (7, 0.8)


@pytest.mark.parametrize("kwargs, name", [(dict(lookahead=-1), "lookahead"),
                                          (dict(lookahead=1.5), "lookahead"),
                                          (dict(decay=0.0), "decay"),
                                          (dict(decay=1.2), "decay")])
def test_defrag_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DefragScheduler(**kwargs)


def test_make_scheduler_validation():
    with pytest.raises(ValueError, match="name"):
        make_scheduler("lifo")
    with pytest.raises(ValueError, match="kwargs"):
        make_scheduler("mtfs", decay=0.5)
    assert make_scheduler("defrag", lookahead=2, decay=0.5).lookahead == 2


# ---------------------------------------------------------------- executor

@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("delivery", [Delivery(), Delivery(seed=3, max_delay=2)])
def test_async_matches_sync_baseline(kernels, scheduler, delivery):
    requests = make_requests(10, seed=0)
    expected = sync_outputs(kernels, requests)
    engine = AsyncEngine(kernels, make_scheduler(scheduler), NUM_DEVICES, NUM_RANKS, SLOTS)
    result = engine.run(requests, delivery=delivery)
    assert result.finished
    assert result.outputs == expected
    for r in requests:
        assert len(expected[r.request_id]) == r.max_new_tokens


def test_sync_baseline_matches_single_request_runs(kernels):
    requests = make_requests(5, seed=1)
    together = SyncEngine(kernels, NUM_DEVICES, NUM_RANKS, SLOTS).run(requests).outputs
    for r in requests:
        alone = SyncEngine(kernels, 1, 1, 1).run([Request(r.request_id, r.prompt,
                                                          r.max_new_tokens)]).outputs
        assert alone[r.request_id] == together[r.request_id]


@given(st.integers(1, 6).flatmap(lambda n: st.tuples(
           st.permutations(range(n)), st.lists(st.integers(0, 8), min_size=n, max_size=n))),
       st.integers(0, 2**16), st.integers(0, 3), st.sampled_from(SCHEDULERS))
def test_no_token_lost_or_duplicated(kernels, order_and_arrivals, seed, max_delay, scheduler):
    order, arrivals = order_and_arrivals
    base = make_requests(len(order), seed=seed)
    requests = [Request(base[i].request_id, base[i].prompt, base[i].max_new_tokens,
                        arrival=arrivals[n]) for n, i in enumerate(order)]
    engine = AsyncEngine(kernels, make_scheduler(scheduler), NUM_DEVICES, NUM_RANKS, SLOTS)
    result = engine.run(requests, delivery=Delivery(seed=seed, max_delay=max_delay),
                        record_log=True)
    assert result.finished
    assert result.outputs == sync_outputs(kernels, base)
    counts = collections.Counter(result.log)
    assert set(counts.values()) == {1}, "a token ran a layer twice"
    expected = set()
    for r in requests:
        for pos, b in itertools.product(range(r.total_len), range(CONFIG.num_blocks)):
            expected.add(("attention", b, r.request_id, pos, None))
            expected.update(("expert", b, r.request_id, pos, j) for j in range(CONFIG.top_k))
        expected.update(("sampler", CONFIG.num_blocks, r.request_id, pos, None)
                        for pos in range(r.total_len))
    assert set(counts) == expected
    for ex in engine.last_executors:
        assert len(ex.queues) == 0 and len(ex.pool) == 0


def test_first_layer_first_livelock(kernels):
    """A new request every tick: FLFS only ever runs block-0 attention; defrag finishes."""
    rng = np.random.default_rng(5)
    window = 40
    requests = [Request(i, [int(rng.integers(0, CONFIG.vocab))], 2, arrival=i)
                for i in range(window)]
    kwargs = dict(num_devices=1, num_ranks=1, slots_per_rank=window)
    flfs = AsyncEngine(kernels, FirstLayerFirst(), **kwargs)
    stalled = flfs.run(requests, max_ticks=window)
    assert not stalled.finished
    assert all(len(out) == 0 for out in stalled.outputs.values())
    (ex,) = flfs.last_executors
    assert set(ex.executions) == {tk.attention_layer(0, 0)}
    assert ex.executions[tk.attention_layer(0, 0)] == window

    defrag = AsyncEngine(kernels, DefragScheduler(), **kwargs)
    within = defrag.run(requests, max_ticks=window)
    # The single device is overloaded (one arrival per tick), yet later layers
    # run and requests complete while arrivals continue.
    assert sum(len(out) == 2 for out in within.outputs.values()) >= 1
    assert tk.sampler_layer(CONFIG.num_blocks, 0) in defrag.last_executors[0].executions
    complete = defrag.run(requests)
    assert complete.finished
    assert complete.outputs == sync_outputs(kernels, requests)


def test_bucketed_compilation_stops_after_warmup():
    config = TinyMoEConfig(vocab=32, hidden=8, ffn=16, heads=2, num_blocks=2, num_experts=2,
                           top_k=1, max_len=12)
    kern = LayerKernels(config, init_params(jax.random.PRNGKey(1), config), max_batch=4)
    rng = np.random.default_rng(0)

    def workload(n, seed):
        r = np.random.default_rng(seed)
        return [Request(i, [int(t) for t in r.integers(0, 32, size=int(r.integers(1, 4)))],
                        int(r.integers(1, 5)), arrival=int(r.integers(0, 4))) for i in range(n)]

    engine = AsyncEngine(kern, DefragScheduler(), num_devices=2, num_ranks=1, slots_per_rank=8)
    counts = []
    for seed in range(6):
        engine.run(workload(8, seed), delivery=Delivery(seed=int(rng.integers(1 << 30)),
                                                        max_delay=1))
        counts.append(kern.compile_count)
    # 3 functions x 3 buckets x 2 devices is the most there can ever be.
    assert 0 < counts[-1] <= 3 * 3 * 2
    assert counts[-1] == counts[-3], counts
    calls = kern.calls
    engine.run(workload(8, 99))
    assert kern.compile_count == counts[-1] and kern.calls > calls


def test_bucket_for():
    assert [bucket_for(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    with pytest.raises(ValueError, match="n must"):
        bucket_for(9, 8)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_timed_engines_match(kernels, scheduler):
    """Simulated-time runs (per-device clocks, modeled cost) give the same tokens."""
    from moe_jax.async_ep.executor import TimedAsyncEngine
    rng = np.random.default_rng(2)
    base = make_requests(8, seed=2)
    requests = [Request(r.request_id, r.prompt, r.max_new_tokens,
                        arrival=float(rng.exponential(2e-3))) for r in base]
    cost = lambda layer, n: 1e-3 + 1e-4 * n  # noqa: E731
    engine = TimedAsyncEngine(kernels, make_scheduler(scheduler), NUM_DEVICES, NUM_RANKS, SLOTS)
    result = engine.run_timed(requests, latency_s=1e-4, cost=cost)
    assert result.finished and result.outputs == sync_outputs(kernels, base)
    sync = SyncEngine(kernels, NUM_DEVICES, NUM_RANKS, SLOTS).run(requests, timed=True,
                                                                   latency_s=1e-4, cost=cost)
    assert sync.finished and sync.outputs == result.outputs
    for times in list(result.token_times.values()) + list(sync.token_times.values()):
        assert times == sorted(times)


def _reference_generate(params, config, prompt, max_new):
    """Whole-sequence numpy forward (causal attention, dense top-k MoE), greedy."""
    def norm(x, s):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * s

    def silu(x):
        return x / (1 + np.exp(-x))

    seq = list(prompt)
    hd = config.hidden // config.heads
    while len(seq) < len(prompt) + max_new:
        n = len(seq)
        x = params["embed"][seq] + params["pos"][:n]
        for p in params["blocks"]:
            xn = norm(x, p["attn_norm"])
            q, k, v = (np.asarray(xn @ p[w]).reshape(n, config.heads, hd) for w in ("wq", "wk", "wv"))
            s = np.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
            s = np.where(np.tril(np.ones((n, n), bool)), s, -1e30)
            a = np.exp(s - s.max(-1, keepdims=True))
            a /= a.sum(-1, keepdims=True)
            h = x + np.einsum("hqk,khd->qhd", a, v).reshape(n, -1) @ p["wo"]
            u = norm(h, p["moe_norm"])
            logits = u @ p["router"] + p["router_bias"]
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            top = np.argsort(-probs, axis=-1, kind="stable")[:, :config.top_k]
            w = np.take_along_axis(probs, top, -1)
            w /= w.sum(-1, keepdims=True)
            ew = p["experts"]
            w_gate, w_up = (np.asarray(a) for a in ew.gate_up())
            out = np.zeros_like(h)
            for j in range(config.top_k):
                e = top[:, j]
                g = np.einsum("nh,nhf->nf", u, w_gate[e])
                up = np.einsum("nh,nhf->nf", u, w_up[e])
                out += w[:, j:j + 1] * np.einsum("nf,nfh->nh", silu(g) * up, ew.w_down[e])
            x = h + out
        logits = norm(x[-1], params["final_norm"]) @ params["lm_head"]
        seq.append(int(np.argmax(logits)))
    return seq[len(prompt):]


def test_sync_baseline_matches_whole_sequence_reference(kernels):
    requests = make_requests(6, seed=4)
    outputs = sync_outputs(kernels, requests)
    for r in requests:
        assert outputs[r.request_id] == _reference_generate(
            kernels.params, CONFIG, r.prompt, r.max_new_tokens)


# ---------------------------------------------------------------- placement, costs, donation

def test_disaggregated_placement():
    from moe_jax.async_ep.dispatcher import Placement
    pl = Placement.disaggregated(4, 2, 8, num_blocks=2)
    assert pl.rank_devices == (0, 1)
    assert pl.expert_devices == (2, 3, 2, 3, 2, 3, 2, 3)
    assert all(layer.kind != tk.EXPERT for layer in pl.layers_on(0))
    assert all(layer.kind == tk.EXPERT for layer in pl.layers_on(3))
    assert Placement.make("colocated", 4, 2, 8, 2) == Placement.colocated(4, 2, 8, 2)
    with pytest.raises(ValueError, match="num_attention_devices"):
        Placement.disaggregated(4, 4, 8, 2)
    with pytest.raises(ValueError, match="layout"):
        Placement.make("ring", 4, 2, 8, 2)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_disaggregated_async_matches_sync(kernels, scheduler):
    """AMoE's layout (attention and experts on different devices), timed and ticked."""
    from moe_jax.async_ep.dispatcher import Placement
    from moe_jax.async_ep.executor import TimedAsyncEngine
    base = make_requests(8, seed=6)
    expected = sync_outputs(kernels, base)
    pl = Placement.disaggregated(NUM_DEVICES, 2, CONFIG.num_experts, CONFIG.num_blocks)
    engine = TimedAsyncEngine(kernels, make_scheduler(scheduler), NUM_DEVICES, 2, SLOTS,
                              placement=pl)
    assert engine.run(base, delivery=Delivery(seed=1, max_delay=2)).outputs == expected
    timed = engine.run_timed([Request(r.request_id, r.prompt, r.max_new_tokens,
                                      arrival=1e-4 * r.request_id) for r in base],
                             latency_s=1e-4, cost=lambda layer, n: 1e-3)
    assert timed.finished and timed.outputs == expected
    busy = timed.device_busy_s
    assert len(busy) == NUM_DEVICES and all(b > 0 for b in busy)
    sync = SyncEngine(kernels, NUM_DEVICES, 2, SLOTS, placement=pl).run(base)
    assert sync.outputs == expected


def test_local_messages_have_no_latency(kernels):
    """One device: every message stays local, so latency must not change the clocks."""
    from moe_jax.async_ep.executor import TimedAsyncEngine
    requests = make_requests(3, seed=7)
    engine = TimedAsyncEngine(kernels, make_scheduler("defrag"), 1, 1, SLOTS)
    cost = lambda layer, n: 1e-3  # noqa: E731
    fast = engine.run_timed(requests, latency_s=0.0, cost=cost)
    slow = engine.run_timed(requests, latency_s=5e-3, cost=cost)
    assert fast.token_times == slow.token_times
    assert fast.outputs == slow.outputs == sync_outputs(kernels, requests)


def test_cost_table():
    from moe_jax.async_ep.costs import CostTable
    table = CostTable.model(1e-4, 1e-6, max_batch=8)
    assert table(tk.expert_layer(0, 1), 3) == pytest.approx(1e-4 + 4e-6)
    assert table(tk.attention_layer(1, 0), 8) == pytest.approx(1e-4 + 8e-6)
    assert CostTable(table.as_dict(), 8).as_dict() == table.as_dict()
    with pytest.raises(ValueError, match="buckets"):
        CostTable({kind: {1: 1.0, 2: 1.0} for kind in tk.KINDS}, 8)


def test_measured_cost_table_and_donated_caches():
    """Measuring costs runs every kind at every bucket without recompiling the
    kernels the engines use; attention donates and chains its KV cache."""
    from moe_jax.async_ep.costs import CostTable
    config = TinyMoEConfig(vocab=32, hidden=8, ffn=16, heads=2, num_blocks=1, num_experts=2,
                           top_k=1, max_len=8)
    kern = LayerKernels(config, init_params(jax.random.PRNGKey(3), config), max_batch=4)
    dev = jax.devices("cpu")[:2]
    kern.warm_up([dev[0]], [dev[1]], slots=3)
    table = CostTable.measure(kern, [dev[0]], [dev[1]], slots=3, rounds=2, chain=2)
    assert set(table.as_dict()) == set(tk.KINDS)
    assert all(set(t) == {1, 2, 4} and all(s > 0 for s in t.values())
               for t in table.as_dict().values())
    cache = kern.new_cache(dev[0], 3)[0]
    x = np.ones((2, 8), np.float32)
    out = kern.attention(dev[0], 0, x, np.zeros(2, np.int32), np.arange(2, dtype=np.int32),
                         cache, 3)
    assert cache[0].is_deleted() and not out[4][0].is_deleted()
    assert np.asarray(out[4][0])[:2, 0].any()


# ---------------------------------------------------------------- expert load skew

@pytest.mark.parametrize("hidden,num_experts,top_k,skew", [
    (16, 4, 2, 3.0), (64, 8, 2, 3.0), (64, 8, 1, 3.0), (512, 8, 2, 1.5), (64, 8, 2, 8.0)])
def test_expert_skew_is_the_realized_load(hidden, num_experts, top_k, skew):
    """The routers' picks on fresh normalized inputs follow exp(-skew * e / E),
    whatever the hidden size (a fixed logit bias would fade as logits grow)."""
    from moe_jax.async_ep.model import (normalized_gaussian_rows, realized_expert_shares,
                                        target_expert_shares)
    config = TinyMoEConfig(vocab=8, hidden=hidden, ffn=8, heads=1, num_blocks=2,
                           num_experts=num_experts, top_k=top_k, max_len=4, expert_skew=skew)
    target = target_expert_shares(num_experts, top_k, skew)
    assert target.sum() == pytest.approx(1.0) and target.max() <= 1 / top_k + 1e-12
    assert np.all(np.diff(target) <= 1e-12)
    uncapped = target < 1 / top_k - 1e-9
    ratios = target[uncapped][1:] / target[uncapped][:-1]
    np.testing.assert_allclose(ratios, np.exp(-skew / num_experts), rtol=1e-9)
    params = init_params(jax.random.PRNGKey(7), config)
    u = normalized_gaussian_rows(16384, hidden, seed=123)
    for p in params["blocks"]:
        share = realized_expert_shares(u @ p["router"] + p["router_bias"], top_k)
        np.testing.assert_allclose(share, target, atol=0.02)


def test_no_skew_is_no_bias_and_skew_validation():
    params = init_params(jax.random.PRNGKey(0), CONFIG)
    assert all(not np.any(p["router_bias"]) for p in params["blocks"])
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="expert_skew"):
            TinyMoEConfig(expert_skew=bad)


# ---------------------------------------------------------------- row-invariant arithmetic

RI_CONFIG = TinyMoEConfig(vocab=64, hidden=24, ffn=40, heads=3, num_blocks=2, num_experts=4,
                          top_k=2, max_len=12, expert_skew=2.0, matmul="row_invariant")


@pytest.fixture(scope="module")
def ri_kernels():
    return LayerKernels(RI_CONFIG, init_params(jax.random.PRNGKey(4), RI_CONFIG), max_batch=8)


def test_kernel_rows_do_not_depend_on_the_batch(ri_kernels):
    """Each output row's bits depend on its own inputs only, at every bucket
    and row count (XLA's arithmetic does not promise it: on CPU the router
    weights of one row already change between 1 and 8 rows)."""
    by_count = kernel_rows_by_count(ri_kernels, jax.devices("cpu")[0], [1, 2, 3, 5, 8])
    assert_rows_independent_of_count(by_count)


def test_row_invariant_arithmetic_is_close_to_xla(ri_kernels):
    import dataclasses
    xla = LayerKernels(dataclasses.replace(RI_CONFIG, matmul="xla"), ri_kernels.params,
                       max_batch=8)
    dev = jax.devices("cpu")[0]
    got = kernel_rows_by_count(ri_kernels, dev, [8], seed=5)[8]
    ref = kernel_rows_by_count(xla, dev, [8], seed=5)[8]
    for i in (0, 1, 3, 4):     # h, u, weights, expert output (ids/tokens may flip on ties)
        np.testing.assert_allclose(got[i], ref[i], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_devices, num_ranks", [(4, 2), (1, 1)])
def test_row_invariant_async_matches_sync(ri_kernels, num_devices, num_ranks):
    requests = random_requests(10, RI_CONFIG.vocab, seed=2, max_new=6)
    outputs = async_and_sync_outputs(ri_kernels, requests, num_devices, num_ranks, 3, "cpu")
    for name, got in outputs.items():
        assert got == outputs["sync"], name
    assert all(len(outputs["sync"][r.request_id]) == r.max_new_tokens for r in requests)


def test_matmul_validation():
    with pytest.raises(ValueError, match="matmul"):
        TinyMoEConfig(matmul="fast")

"""Tests of moe_jax.traces: the calibrated generator, per-peer counts, JSONL I/O."""

import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


from moe_jax import traces as traces_mod

RoutingTrace = traces_mod.RoutingTrace
TraceModel = traces_mod.TraceModel
generate_traces = traces_mod.generate_traces
per_peer_counts = traces_mod.per_peer_counts
save_jsonl = traces_mod.save_jsonl
load_jsonl = traces_mod.load_jsonl
TARGETS = traces_mod.MIXTRAL_8X7B_EP8_TARGETS


def _stats(counts):
    flat = counts.reshape(-1)
    over = counts > 16
    return {
        "mean": flat.mean(),
        "sd": flat.std(),
        "q99": int(np.quantile(flat, 0.99, method="inverted_cdf")),
        "max": int(flat.max()),
        "slices": over.any(axis=-1).mean(),
    }


@pytest.fixture(scope="module")
def preset_counts():
    t0 = time.perf_counter()
    traces = generate_traces(seed=0)
    elapsed = time.perf_counter() - t0
    return traces, per_peer_counts(traces), elapsed


# --------------------------------------------------------------------------
# The fitted preset
# --------------------------------------------------------------------------


def test_preset_reproduces_published_statistics(preset_counts):
    traces, counts, elapsed = preset_counts
    assert len(traces) == 32 * 1000
    assert counts.shape == (32000, 8, 8)
    assert counts.size == 2_048_000
    s = _stats(counts)
    for key in ("mean", "q99", "max", "sd"):
        assert abs(s[key] - TARGETS[key]) <= 0.10 * TARGETS[key], (key, s[key])
    assert s["q99"] == 16
    assert abs(s["sd"] - 3.6) <= 0.1
    # Fraction of (step, layer, source) dispatch slices above C = 16: 5.4% published.
    assert 0.045 <= s["slices"] <= 0.065, s["slices"]
    assert elapsed < 20.0, elapsed


@pytest.mark.parametrize("seed", [1, 2])
def test_preset_statistics_are_stable_across_seeds(seed):
    s = _stats(per_peer_counts(generate_traces(seed=seed)))
    for key in ("mean", "q99", "max", "sd"):
        assert abs(s[key] - TARGETS[key]) <= 0.10 * TARGETS[key], (key, s[key])


def test_preset_constructor():
    m = traces_mod.mixtral_8x7b_ep8()
    assert (m.num_experts, m.num_ranks, m.top_k, m.num_layers, m.num_steps) == (8, 8, 2, 32, 1000)
    assert m == TraceModel()
    assert abs(m.expected_count_mean() - 5.1) < 0.05
    small = traces_mod.mixtral_8x7b_ep8(num_steps=3, num_layers=2)
    assert small.num_steps == 3 and small.skew == m.skew
    assert small.generate(seed=5) == generate_traces(num_steps=3, num_layers=2, seed=5)
    assert small.replace(skew=0.0).skew == 0.0


def test_sampled_token_counts_follow_the_mixture():
    m = TraceModel()
    t = m.sample_tokens_per_rank(1000, np.random.default_rng(0))
    assert t.dtype == np.int64 and t.shape == (1000,)
    assert (t >= 1).all() and t.max() <= m.prefill_max_tokens
    assert abs(t.mean() - m.mean_tokens_per_rank()) < 0.5
    assert (t >= m.prefill_min_tokens).sum() >= 40  # exactly 40 prefill steps, maybe a decode one


# --------------------------------------------------------------------------
# Structure, determinism, other layouts
# --------------------------------------------------------------------------


def test_trace_structure():
    traces = generate_traces(num_steps=5, num_layers=3, seed=3)
    assert len(traces) == 15
    next_id = 0
    for s in range(5):
        step_traces = traces[s * 3:(s + 1) * 3]
        assert [t.layer for t in step_traces] == [0, 1, 2]
        assert all(t.step == s for t in step_traces)
        first = step_traces[0]
        T = first.num_tokens
        assert T % 8 == 0 and T >= 8
        np.testing.assert_array_equal(first.token_idx, np.arange(next_id, next_id + T))
        next_id += T
        for t in step_traces:
            assert t.experts.dtype == np.int32 and t.experts.shape == (T, 2)
            assert t.gating_probs.dtype == np.float32 and t.gating_probs.shape == (T, 2)
            assert t.token_idx.dtype == np.int64
            assert t.source_rank is None and t.num_ranks == 8 and t.num_experts == 8
            np.testing.assert_array_equal(t.token_idx, first.token_idx)
            assert (t.experts[:, 0] != t.experts[:, 1]).all()
            assert ((t.experts >= 0) & (t.experts < 8)).all()
            np.testing.assert_allclose(t.gating_probs.sum(axis=1), 1.0, atol=1e-6)
            assert (t.gating_probs[:, 0] >= t.gating_probs[:, 1]).all()
            np.testing.assert_array_equal(t.source_ranks(), np.repeat(np.arange(8), T // 8))


def test_deterministic_per_seed():
    a = generate_traces(num_steps=20, num_layers=4, seed=11)
    b = generate_traces(num_steps=20, num_layers=4, seed=11)
    c = generate_traces(num_steps=20, num_layers=4, seed=12)
    assert a == b
    assert a != c
    for x, y in zip(a, b):
        assert x.gating_probs.tobytes() == y.gating_probs.tobytes()


def test_fixed_tokens_per_rank():
    traces = generate_traces(num_steps=7, num_layers=2, tokens_per_rank=24, seed=0)
    assert all(t.num_tokens == 8 * 24 for t in traces)
    counts = per_peer_counts(traces)
    np.testing.assert_array_equal(counts.sum(axis=2), 24 * 2)


def test_tokens_per_rank_sequence():
    tps = [3, 9, 1]
    traces = generate_traces(num_steps=3, num_layers=2, tokens_per_rank=tps, seed=0)
    assert [t.num_tokens for t in traces] == [24, 24, 72, 72, 8, 8]
    with pytest.raises(ValueError, match="tokens_per_rank"):
        generate_traces(num_steps=3, tokens_per_rank=[1, 2])
    with pytest.raises(ValueError, match="tokens_per_rank"):
        generate_traces(num_steps=2, tokens_per_rank=0)
    with pytest.raises(ValueError, match="tokens_per_rank"):
        generate_traces(num_steps=2, tokens_per_rank=[1.5, 2.0])


@pytest.mark.parametrize("E,P,k", [(8, 4, 2), (256, 8, 8), (16, 2, 1), (64, 16, 6), (8, 1, 8)])
def test_other_layouts(E, P, k):
    traces = generate_traces(num_experts=E, num_ranks=P, top_k=k, num_layers=2, num_steps=6,
                             tokens_per_rank=10, seed=1)
    counts = per_peer_counts(traces)
    assert counts.shape == (12, P, P)
    np.testing.assert_array_equal(counts.sum(axis=2), 10 * k)
    for t in traces:
        assert t.experts.shape == (10 * P, k)
        assert ((t.experts >= 0) & (t.experts < E)).all()
        srt = np.sort(t.experts, axis=1)
        assert (np.diff(srt, axis=1) > 0).all()
    # the default (mixture) token counts work for other layouts too
    traces = generate_traces(num_experts=E, num_ranks=P, top_k=k, num_layers=1, num_steps=4)
    assert all(t.num_tokens % P == 0 for t in traces)


def test_skew_zero_is_uniform_and_skew_overdisperses():
    uniform = per_peer_counts(generate_traces(num_layers=4, num_steps=100, tokens_per_rank=64,
                                              skew=0.0, seed=0))
    share = uniform.sum(axis=(0, 1)) / uniform.sum()
    np.testing.assert_allclose(share, 1 / 8, atol=0.01)
    skewed = per_peer_counts(generate_traces(num_layers=4, num_steps=100, tokens_per_rank=64,
                                             skew=1.0, seed=0))
    assert skewed.std() > 1.5 * uniform.std()
    assert abs(skewed.mean() - uniform.mean()) < 1e-9  # T * k / P either way


def test_sample_routing():
    rng = np.random.default_rng(0)
    experts, gating = traces_mod.sample_routing(rng, 1000, num_experts=16, top_k=4)
    assert experts.shape == gating.shape == (1000, 4)
    assert experts.dtype == np.int32 and gating.dtype == np.float32
    assert (np.diff(np.sort(experts, axis=1), axis=1) > 0).all()
    np.testing.assert_allclose(gating.sum(axis=1), 1.0, atol=1e-6)
    # A dominant bias sends nearly every token to that expert.
    bias = np.zeros(16)
    bias[5] = 20.0
    experts, _ = traces_mod.sample_routing(rng, 200, num_experts=16, top_k=4, bias=bias)
    assert (experts[:, 0] == 5).all()


@pytest.mark.parametrize("kwargs,field", [
    ({"num_experts": 6, "num_ranks": 4}, "num_experts"),
    ({"num_ranks": 0}, "num_ranks"),
    ({"top_k": 9}, "top_k"),
    ({"skew": -0.1}, "skew"),
    ({"skew": float("nan")}, "skew"),
    ({"num_steps": 0}, "num_steps"),
    ({"num_layers": 0}, "num_layers"),
    ({"prefill_prob": 1.5}, "prefill_prob"),
    ({"prefill_min_tokens": 10, "prefill_max_tokens": 5}, "prefill_max_tokens"),
    ({"seed": 1.5}, "seed"),
])
def test_generator_validates_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        generate_traces(**kwargs)


# --------------------------------------------------------------------------
# per_peer_counts
# --------------------------------------------------------------------------


def _brute_force_counts(traces, P, E):
    out = np.zeros((len(traces), P, P), np.int64)
    for n, t in enumerate(traces):
        src = t.source_ranks() if t.source_rank is not None else \
            np.repeat(np.arange(P), t.num_tokens // P)
        for tok in range(t.num_tokens):
            for e in t.experts[tok]:
                out[n, src[tok], e // (E // P)] += 1
    return out


@st.composite
def _random_trace(draw, P, E, explicit_ranks):
    k = draw(st.integers(1, min(E, 3)))
    T = draw(st.integers(0, 6)) * (1 if explicit_ranks else P)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    experts = np.array([rng.permutation(E)[:k] for _ in range(T)], np.int32).reshape(T, k)
    w = rng.random((T, k)).astype(np.float32) + np.float32(0.01)
    w /= w.sum(axis=1, keepdims=True)
    src = rng.integers(0, P, T).astype(np.int32) if explicit_ranks else None
    return RoutingTrace(layer=draw(st.integers(0, 5)), experts=experts, gating_probs=w,
                        token_idx=rng.permutation(1000)[:T], num_ranks=P, num_experts=E,
                        step=draw(st.integers(0, 5)), source_rank=src)


@st.composite
def _trace_lists(draw):
    P = draw(st.sampled_from([1, 2, 4]))
    E = P * draw(st.integers(1, 3))
    n = draw(st.integers(1, 4))
    traces = [draw(_random_trace(P, E, draw(st.booleans()))) for _ in range(n)]
    return traces, P, E


@settings(max_examples=60, deadline=None)
@given(_trace_lists())
def test_per_peer_counts_matches_brute_force(data):
    traces, P, E = data
    counts = per_peer_counts(traces)
    assert counts.dtype == np.int64
    np.testing.assert_array_equal(counts, _brute_force_counts(traces, P, E))


def test_per_peer_counts_by_hand():
    # P = 2 ranks, E = 4 experts (2 per rank), k = 2, 4 tokens: rank 0 has tokens 0-1.
    t = RoutingTrace(layer=0, experts=[[0, 1], [0, 2], [3, 2], [1, 3]],
                     gating_probs=[[0.5, 0.5]] * 4, token_idx=[0, 1, 2, 3],
                     num_ranks=2, num_experts=4)
    np.testing.assert_array_equal(per_peer_counts(t), [[[3, 1], [1, 3]]])
    # The same routing seen as E = 4 experts on 4 ranks (override).
    np.testing.assert_array_equal(
        per_peer_counts(t, num_ranks=4),
        [[[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1], [0, 1, 0, 1]]])
    # Explicit source ranks.
    u = RoutingTrace(layer=0, experts=[[0, 1], [0, 2], [3, 2]], gating_probs=[[0.5, 0.5]] * 3,
                     token_idx=[5, 6, 7], num_ranks=2, num_experts=4, source_rank=[1, 1, 0])
    np.testing.assert_array_equal(per_peer_counts([t, u])[1], [[0, 2], [3, 1]])


def test_per_peer_counts_errors():
    a = generate_traces(num_steps=1, num_layers=1, tokens_per_rank=2, seed=0)
    b = generate_traces(num_experts=8, num_ranks=4, num_steps=1, num_layers=1,
                        tokens_per_rank=2, seed=0)
    with pytest.raises(ValueError, match="num_ranks"):
        per_peer_counts(a + b)
    with pytest.raises(ValueError, match="traces"):
        per_peer_counts([])
    with pytest.raises(ValueError, match="traces"):
        per_peer_counts([np.zeros((2, 2))])
    with pytest.raises(ValueError, match="num_experts"):
        per_peer_counts(a, num_experts=4, num_ranks=4)  # ids up to 7 do not fit in 4
    assert per_peer_counts(a + b, num_ranks=2).shape == (2, 2, 2)


# --------------------------------------------------------------------------
# RoutingTrace validation
# --------------------------------------------------------------------------

_GOOD = dict(layer=0, experts=[[0, 1], [2, 3]], gating_probs=[[0.6, 0.4], [1.0, 0.0]],
             token_idx=[0, 1], num_ranks=2, num_experts=4)


@pytest.mark.parametrize("change,field", [
    ({"layer": -1}, "layer"),
    ({"layer": 1.0}, "layer"),
    ({"step": -2}, "step"),
    ({"experts": [[0, 0], [2, 3]]}, "experts"),
    ({"experts": [[0, 4], [2, 3]]}, "experts"),
    ({"experts": [[0.0, 1.0], [2.0, 3.0]]}, "experts"),
    ({"experts": [0, 1]}, "experts"),
    ({"gating_probs": [[0.6, 0.4]]}, "gating_probs"),
    ({"gating_probs": [[0.6, 0.3], [1.0, 0.0]]}, "gating_probs"),
    ({"gating_probs": [[1.5, -0.5], [1.0, 0.0]]}, "gating_probs"),
    ({"gating_probs": [[np.nan, 1.0], [1.0, 0.0]]}, "gating_probs"),
    ({"token_idx": [0, 0]}, "token_idx"),
    ({"token_idx": [0]}, "token_idx"),
    ({"token_idx": [-1, 0]}, "token_idx"),
    ({"num_experts": 3}, "num_experts"),
    ({"num_ranks": 0}, "num_ranks"),
    ({"source_rank": [0, 2]}, "source_rank"),
    ({"source_rank": [0]}, "source_rank"),
    ({"experts": [[0, 1], [2, 3], [1, 2]], "gating_probs": [[0.5, 0.5]] * 3,
      "token_idx": [0, 1, 2]}, "source_rank"),
])
def test_routing_trace_validation(change, field):
    with pytest.raises(ValueError, match=field):
        RoutingTrace(**{**_GOOD, **change})


def test_routing_trace_converts_dtypes_and_compares_bitwise():
    t = RoutingTrace(**_GOOD)
    assert t.experts.dtype == np.int32 and t.gating_probs.dtype == np.float32
    assert t.token_idx.dtype == np.int64
    assert t == RoutingTrace(**_GOOD)
    assert t != RoutingTrace(**{**_GOOD, "step": 1})
    nudged = np.array(_GOOD["gating_probs"], np.float32)
    nudged[0, 0] = np.nextafter(nudged[0, 0], np.float32(1))
    assert t != RoutingTrace(**{**_GOOD, "gating_probs": nudged})
    np.testing.assert_array_equal(t.dest_ranks(), [[0, 0], [1, 1]])


# --------------------------------------------------------------------------
# JSONL
# --------------------------------------------------------------------------


def test_jsonl_round_trip_is_bitwise(tmp_path):
    traces = generate_traces(num_steps=30, num_layers=4, seed=7)
    path = tmp_path / "traces.jsonl"
    save_jsonl(traces, path)
    loaded = load_jsonl(path)
    assert len(loaded) == len(traces)
    for a, b in zip(traces, loaded):
        assert a == b
        assert b.experts.dtype == np.int32 and b.token_idx.dtype == np.int64
        assert a.gating_probs.view(np.uint32).tobytes() == b.gating_probs.view(np.uint32).tobytes()
    np.testing.assert_array_equal(per_peer_counts(loaded), per_peer_counts(traces))


@settings(max_examples=40, deadline=None)
@given(_trace_lists(), st.integers(0, 2**32 - 1))
def test_jsonl_round_trip_random(tmp_path_factory, data, seed):
    traces, _, _ = data
    # Arbitrary float32 bit patterns of renormalized weights.
    rng = np.random.default_rng(seed)
    rebuilt = []
    for t in traces:
        w = (rng.random(t.gating_probs.shape) ** 8).astype(np.float32) + np.float32(1e-7)
        w /= w.sum(axis=1, keepdims=True, dtype=np.float32)
        rebuilt.append(RoutingTrace(layer=t.layer, experts=t.experts, gating_probs=w,
                                    token_idx=t.token_idx, num_ranks=t.num_ranks,
                                    num_experts=t.num_experts, step=t.step,
                                    source_rank=t.source_rank))
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    save_jsonl(rebuilt, path)
    assert load_jsonl(path) == rebuilt


def test_jsonl_minimal_records_and_defaults(tmp_path):
    path = tmp_path / "min.jsonl"
    lines = [
        {"layer": 3, "experts": [[1, 5], [0, 2]], "gating_probs": [[0.7, 0.3], [0.5, 0.5]],
         "token_idx": [0, 1]},
        {"layer": 3, "experts": [[1, 5], [0, 2]], "gating_probs": [[0.7, 0.3], [0.5, 0.5]],
         "token_idx": [2, 3], "comment": "unknown fields are ignored"},
        {"layer": 4, "experts": [], "gating_probs": [], "token_idx": [], "top_k": 2},
    ]
    path.write_text("\n".join(json.dumps(r) for r in lines[:2]) + "\n\n" +
                    json.dumps(lines[2]) + "\n")
    loaded = load_jsonl(path, num_ranks=2)
    assert [t.step for t in loaded] == [0, 1, 0]
    assert all(t.num_ranks == 2 and t.num_experts == 8 for t in loaded)
    assert loaded[2].experts.shape == (0, 2)
    np.testing.assert_array_equal(per_peer_counts(loaded[:1]), [[[1, 1], [2, 0]]])
    assert load_jsonl(path, num_ranks=2, num_experts=8) == loaded
    with pytest.raises(ValueError, match=r"line 1: experts"):
        load_jsonl(path, num_ranks=2, num_experts=4)  # expert 5 >= 4


def test_jsonl_with_source_rank_and_empty_trace(tmp_path):
    t1 = RoutingTrace(layer=1, experts=[[0, 1], [2, 3], [1, 2]],
                      gating_probs=[[0.25, 0.75], [0.5, 0.5], [1.0, 0.0]],
                      token_idx=[9, 4, 7], num_ranks=2, num_experts=4, step=3,
                      source_rank=[1, 0, 1])
    t2 = RoutingTrace(layer=2, experts=np.zeros((0, 3), np.int32),
                      gating_probs=np.zeros((0, 3), np.float32), token_idx=[],
                      num_ranks=4, num_experts=8, step=0)
    path = tmp_path / "x.jsonl"
    save_jsonl([t1, t2], path)
    assert load_jsonl(path) == [t1, t2]


_GOOD_RECORD = {"layer": 0, "step": 0, "num_ranks": 2, "num_experts": 4,
                "experts": [[0, 1], [2, 3]], "gating_probs": [[0.6, 0.4], [0.5, 0.5]],
                "token_idx": [0, 1]}


def _bad(**change):
    rec = {**_GOOD_RECORD, **change}
    return json.dumps({k: v for k, v in rec.items() if v is not _DROP})


_DROP = object()


@pytest.mark.parametrize("line,field", [
    ("{not json", "json"),
    ("[1, 2]", "record"),
    (_bad(layer=_DROP), "layer"),
    (_bad(experts=_DROP), "experts"),
    (_bad(gating_probs=_DROP), "gating_probs"),
    (_bad(token_idx=_DROP), "token_idx"),
    (_bad(layer="3"), "layer"),
    (_bad(layer=-1), "layer"),
    (_bad(layer=True), "layer"),
    (_bad(step=1.5), "step"),
    (_bad(num_ranks=3), "num_experts"),
    (_bad(num_ranks=0), "num_ranks"),
    (_bad(experts=[[0, 1], [2]]), "experts"),
    (_bad(experts=[[0, 1], [2, 2]]), "experts"),
    (_bad(experts=[[0, 1], [2, 4]]), "experts"),
    (_bad(experts=[[0, 1], [2, 3.0]]), "experts"),
    (_bad(experts=[[0, 1], "ab"]), "experts"),
    (_bad(experts=[0, 1]), "experts"),
    (_bad(experts={"a": 1}), "experts"),
    (_bad(gating_probs=[[0.6, 0.4]]), "gating_probs"),
    (_bad(gating_probs=[[0.6, 0.4], [0.5, "x"]]), "gating_probs"),
    (_bad(gating_probs=[[0.6, 0.4], [0.9, 0.5]]), "gating_probs"),
    (_bad(gating_probs=[[1.2, -0.2], [0.5, 0.5]]), "gating_probs"),
    (_bad(token_idx=[0]), "token_idx"),
    (_bad(token_idx=[1, 1]), "token_idx"),
    (_bad(token_idx=[0, 2**70]), "token_idx"),
    (_bad(source_rank=[0, 2]), "source_rank"),
    (_bad(source_rank=[0]), "source_rank"),
    (_bad(experts=[[0, 1], [2, 3], [0, 3]], gating_probs=[[0.5, 0.5]] * 3,
          token_idx=[0, 1, 2]), "source_rank"),
    (_bad(top_k=3), "top_k"),
    (_bad(experts=[], gating_probs=[], token_idx=[]), "top_k"),
])
def test_jsonl_bad_lines_name_field_and_line(tmp_path, line, field):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_GOOD_RECORD) + "\n\n" + line + "\n" + json.dumps(_GOOD_RECORD) + "\n")
    with pytest.raises(ValueError) as info:
        load_jsonl(path)
    msg = str(info.value)
    assert "line 3:" in msg, msg
    assert field in msg.split("line 3:", 1)[1], msg


def test_good_record_loads(tmp_path):
    path = tmp_path / "good.jsonl"
    path.write_text(json.dumps(_GOOD_RECORD) + "\n")
    (t,) = load_jsonl(path)
    assert t.num_ranks == 2 and t.num_experts == 4 and t.step == 0


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3]), st.integers(1, 3),
       st.integers(0, 2**32 - 1))
def test_per_peer_counts_of_data_groups_are_each_groups_own(P, G, per_rank, seed):
    """With num_groups=G every group's [P, P] counts are those of a trace
    holding only that group's tokens (its G * P shards, group-major)."""
    rng = np.random.default_rng(seed)
    E, k, T = P * per_rank, min(2, P * per_rank), G * P * int(rng.integers(0, 4))
    experts = np.array([rng.permutation(E)[:k] for _ in range(T)], np.int32).reshape(T, k)
    w = np.full((T, k), 1.0 / k, np.float32)
    traces = [RoutingTrace(layer=0, experts=experts, gating_probs=w, token_idx=np.arange(T),
                           num_ranks=P, num_experts=E, step=s) for s in range(2)]
    counts = per_peer_counts(traces, num_groups=G)
    assert counts.shape == (2 * G, P, P)
    per_group = T // G
    for n in range(2):
        for g in range(G):
            part = slice(g * per_group, (g + 1) * per_group)
            own = RoutingTrace(layer=0, experts=experts[part], gating_probs=w[part],
                               token_idx=np.arange(per_group), num_ranks=P, num_experts=E)
            np.testing.assert_array_equal(counts[n * G + g], per_peer_counts(own)[0])


def test_per_peer_counts_num_groups_errors():
    t = RoutingTrace(layer=0, experts=[[0, 1], [0, 2], [3, 2], [1, 3]],
                     gating_probs=[[0.5, 0.5]] * 4, token_idx=[0, 1, 2, 3],
                     num_ranks=2, num_experts=4)
    with pytest.raises(ValueError, match="num_groups: a trace's token count"):
        per_peer_counts(t, num_groups=3)
    with pytest.raises(ValueError, match="num_groups: must be"):
        per_peer_counts(t, num_groups=0)
    u = RoutingTrace(layer=0, experts=[[0, 1]], gating_probs=[[0.5, 0.5]], token_idx=[0],
                     num_ranks=2, num_experts=4, source_rank=[1])
    with pytest.raises(ValueError, match="num_groups: > 1 needs traces without source_rank"):
        per_peer_counts(u, num_groups=2)
    # Two groups of 2 ranks, one token per rank: group 0 holds tokens 0-1,
    # group 1 tokens 2-3; experts 0-1 live on rank 0, 2-3 on rank 1.
    np.testing.assert_array_equal(per_peer_counts(t, num_groups=2),
                                  [[[2, 0], [1, 1]], [[0, 2], [1, 1]]])

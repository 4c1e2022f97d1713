"""Tests of moe_jax.calibration: capacity C, spill capacity S and overflow rates."""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


from moe_jax import calibration as cal, traces as traces_mod

calibrate = cal.calibrate
overflow_rates = cal.overflow_rates


def _inverse_cdf(values, q):
    """Smallest observed value v with fraction(values <= v) >= q: the
    ceil(q * n)-th smallest value (brute force)."""
    values = np.sort(np.asarray(values).reshape(-1))
    return int(values[max(0, math.ceil(q * values.size) - 1)])


@pytest.fixture(scope="module")
def preset():
    traces = traces_mod.generate_traces(seed=0)
    return traces, traces_mod.per_peer_counts(traces)


# --------------------------------------------------------------------------
# On the calibrated Mixtral-8x7B EP8 traces
# --------------------------------------------------------------------------


def test_calibrate_generated_traces(preset):
    traces, counts = preset
    c = calibrate(traces, 0.99)
    assert abs(c.capacity - 16) <= 1
    assert c.spill_capacity >= 1
    assert c.total_capacity == c.capacity + c.spill_capacity
    assert c.quantile == 0.99 and c.spill_quantile == 0.999
    assert c.num_observations == 2_048_000 and c.num_steps == 32_000
    assert abs(c.count_mean - 5.1) < 0.51 and abs(c.count_sd - 3.6) < 0.36
    assert c.count_q99 == 16 and abs(c.count_max - 43) <= 4
    # overflow rates are sane and ordered
    assert 0.0 < c.frac_counts_over_capacity <= 0.01
    assert 0.03 < c.frac_slices_spill < 0.08       # 5.4% published
    assert c.frac_counts_over_capacity <= c.frac_slices_spill <= c.frac_steps_spill < 0.5
    assert c.frac_counts_over_total <= c.frac_slices_fallback <= c.frac_steps_fallback
    assert c.frac_counts_over_total <= 0.01 * 0.001 + 1e-12
    assert c.frac_steps_fallback < 0.005
    for name in ("counts", "slices", "steps"):
        spill = getattr(c, f"frac_{name}_spill" if name != "counts" else
                        "frac_counts_over_capacity")
        fb = getattr(c, f"frac_{name}_fallback" if name != "counts" else
                     "frac_counts_over_total")
        assert fb <= spill


def test_traces_and_counts_inputs_agree(preset):
    traces, counts = preset
    sub = traces[:3200]
    a = calibrate(sub)
    b = calibrate(counts[:3200])
    assert a == b
    flat = calibrate(counts[:3200].reshape(-1))
    assert (flat.capacity, flat.spill_capacity) == (a.capacity, a.spill_capacity)
    assert flat.frac_counts_over_capacity == a.frac_counts_over_capacity
    assert flat.num_steps is None
    assert math.isnan(flat.frac_slices_spill) and math.isnan(flat.frac_steps_fallback)
    assert calibrate(traces[0]).num_steps == 1


def test_overflow_rates_at_published_capacity(preset):
    _, counts = preset
    r = overflow_rates(counts, 16)
    assert r["counts_over_capacity"] <= 0.01
    assert abs(r["slices_over_capacity"] - 0.054) < 0.01
    assert r["slices_over_capacity"] <= r["steps_over_capacity"]
    assert r["counts_over_total"] == r["counts_over_capacity"]  # S = 0
    c = calibrate(counts)
    r = overflow_rates(counts, c.capacity, c.spill_capacity)
    assert r["counts_over_capacity"] == c.frac_counts_over_capacity
    assert r["slices_over_total"] == c.frac_slices_fallback
    assert r["steps_over_total"] == c.frac_steps_fallback
    flat = overflow_rates(counts.reshape(-1), 16)
    assert math.isnan(flat["steps_over_capacity"])


def test_include_self_false(preset):
    _, counts = preset
    c = calibrate(counts[:1000], include_self=False)
    assert c.num_observations == 1000 * 8 * 7
    off = counts[:1000][:, ~np.eye(8, dtype=bool)]
    assert c.capacity == max(1, _inverse_cdf(off, 0.99))
    assert c.count_max == off.max()
    with pytest.raises(ValueError, match="include_self"):
        calibrate(counts.reshape(-1), include_self=False)


def test_quantile_sweep_is_monotone(preset):
    _, counts = preset
    caps = [calibrate(counts, q).capacity for q in (0.5, 0.9, 0.95, 0.99, 0.999, 0.9999)]
    assert caps == sorted(caps)
    assert caps[3] == 16


# --------------------------------------------------------------------------
# Exact small cases
# --------------------------------------------------------------------------


def test_hand_computed_example():
    # 100 counts: 90 x 2, 9 x 10, 1 x 30.
    counts = np.array([2] * 90 + [10] * 9 + [30])
    c = calibrate(counts, 0.9, 0.5)
    assert c.capacity == 2            # P(count <= 2) = 0.90 >= 0.9
    # overflows: 9 x 8 and 1 x 28; their 0.5 quantile is 8
    assert c.spill_capacity == 8
    assert c.frac_counts_over_capacity == pytest.approx(0.10)
    assert c.frac_counts_over_total == pytest.approx(0.01)
    c = calibrate(counts, 0.95, 0.95)
    assert c.capacity == 10 and c.spill_capacity == 20
    assert c.frac_counts_over_total == 0.0
    assert c.count_max == 30 and c.count_q99 == 10
    assert c.count_mean == pytest.approx(counts.mean()) and c.count_sd == pytest.approx(counts.std())


def test_minimums_and_no_overflow():
    zeros = np.zeros((4, 2, 2), np.int64)
    c = calibrate(zeros)
    assert c.capacity == 1 and c.spill_capacity == 1
    assert c.frac_counts_over_capacity == 0.0 and c.frac_steps_spill == 0.0
    c = calibrate(np.array([5, 5, 5]))
    assert c.capacity == 5 and c.spill_capacity == 1


def test_step_and_slice_rates_by_hand():
    counts = np.zeros((4, 2, 2), np.int64)
    counts[0, 0, 1] = 9          # step 0, source 0 overflows
    counts[0, 1, 0] = 9          # step 0, source 1 overflows
    counts[2, 1, 1] = 9          # step 2, source 1 overflows
    r = overflow_rates(counts, 3)
    assert r["counts_over_capacity"] == 3 / 16
    assert r["slices_over_capacity"] == 3 / 8
    assert r["steps_over_capacity"] == 2 / 4


def test_float_integral_counts_are_accepted():
    c = calibrate(np.array([1.0, 2.0, 3.0, 4.0]), 0.5)
    assert c.capacity == 2


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,field", [
    ({"quantile": 0.0}, "quantile"),
    ({"quantile": 1.0}, "quantile"),
    ({"quantile": 1.5}, "quantile"),
    ({"quantile": -0.1}, "quantile"),
    ({"quantile": float("nan")}, "quantile"),
    ({"quantile": "0.99"}, "quantile"),
    ({"quantile": True}, "quantile"),
    ({"spill_quantile": 0.0}, "spill_quantile"),
    ({"spill_quantile": 1.0}, "spill_quantile"),
    ({"spill_quantile": None}, "spill_quantile"),
    ({"include_self": "no"}, "include_self"),
    ({"num_ranks": 3}, "num_ranks"),
    ({"num_ranks": 0}, "num_ranks"),
    ({"num_experts": -1}, "num_experts"),
])
def test_calibrate_validates_arguments(kwargs, field):
    counts = np.ones((2, 2, 2), np.int64)
    with pytest.raises(ValueError, match=field):
        calibrate(counts, **kwargs)


@pytest.mark.parametrize("counts", [
    np.array([]),
    np.array([1, -1]),
    np.array([1.5, 2.0]),
    np.array([1.0, np.inf]),
    np.ones((2, 3)),
    np.ones((2, 2, 3)),
    np.ones((1, 1, 1, 1)),
    np.array(["a", "b"]),
    np.array([True, False]),
    [],
    "counts",
])
def test_calibrate_rejects_bad_counts(counts):
    with pytest.raises(ValueError, match="traces_or_counts"):
        calibrate(counts)


def test_calibrate_rejects_mixed_and_mismatched_traces():
    t = traces_mod.generate_traces(num_steps=1, num_layers=1, tokens_per_rank=2)
    with pytest.raises(ValueError, match="traces_or_counts"):
        calibrate(t + [3])
    u = traces_mod.generate_traces(num_ranks=4, num_steps=1, num_layers=1, tokens_per_rank=2)
    with pytest.raises(ValueError, match="num_ranks"):
        calibrate(t + u)
    assert calibrate(t + u, num_ranks=2).num_observations == 2 * 4


def test_overflow_rates_validates():
    with pytest.raises(ValueError, match="capacity"):
        overflow_rates(np.ones(3), -1)
    with pytest.raises(ValueError, match="spill_capacity"):
        overflow_rates(np.ones(3), 1, 1.5)
    with pytest.raises(ValueError, match="traces_or_counts"):
        overflow_rates(np.ones((2, 3)), 1)


# --------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------

_quantiles = st.floats(min_value=1e-3, max_value=1 - 1e-3, allow_nan=False)


@st.composite
def _step_counts(draw):
    P = draw(st.integers(1, 4))
    n = draw(st.integers(1, 12))
    return draw(hnp.arrays(np.int64, (n, P, P), elements=st.integers(0, 60)))


_flat_counts = hnp.arrays(np.int64, st.integers(1, 300), elements=st.integers(0, 80))


@settings(max_examples=150, deadline=None)
@given(_flat_counts, _quantiles, _quantiles)
def test_capacity_is_monotone_in_quantile(counts, q1, q2):
    lo, hi = sorted((q1, q2))
    assert calibrate(counts, lo).capacity <= calibrate(counts, hi).capacity


@settings(max_examples=200, deadline=None)
@given(st.one_of(_flat_counts, _step_counts()), _quantiles, _quantiles)
def test_calibration_properties(counts, q, sq):
    c = calibrate(counts, q, sq)
    flat = counts.reshape(-1)
    n = flat.size
    # C is the inverse-CDF quantile (at least 1)
    assert c.capacity == max(1, int(np.quantile(flat, q, method="inverted_cdf")))
    assert c.capacity >= 1 and c.spill_capacity >= 1
    assert np.count_nonzero(flat <= c.capacity) >= q * n * (1 - 1e-12)
    # overflow fraction at C is at most 1 - q
    assert c.frac_counts_over_capacity <= 1 - q + 1e-9
    assert c.frac_counts_over_capacity == np.count_nonzero(flat > c.capacity) / n
    # C + S covers the spill quantile of the counts themselves
    assert c.total_capacity >= np.quantile(flat, sq, method="inverted_cdf")
    # the fallback takes at most a (1 - q)(1 - sq) share of the counts
    assert c.frac_counts_over_total <= (1 - q) * (1 - sq) + 1e-9
    assert c.frac_counts_over_total == np.count_nonzero(flat > c.total_capacity) / n
    # S is the smallest spill capacity with that guarantee among overflowing pairs
    over = flat[flat > c.capacity] - c.capacity
    if over.size and c.spill_capacity > 1:
        assert np.count_nonzero(over <= c.spill_capacity - 1) < sq * over.size + 1e-9
    # granularity ordering
    if counts.ndim == 3:
        assert c.num_steps == counts.shape[0]
        assert c.frac_counts_over_capacity <= c.frac_slices_spill <= c.frac_steps_spill <= 1
        assert c.frac_counts_over_total <= c.frac_slices_fallback <= c.frac_steps_fallback
        assert c.frac_slices_fallback <= c.frac_slices_spill
        assert c.frac_steps_fallback <= c.frac_steps_spill
    assert c.count_max == flat.max() and c.count_mean == pytest.approx(flat.mean())


@settings(max_examples=100, deadline=None)
@given(_flat_counts, _quantiles, _quantiles, st.randoms(use_true_random=False))
def test_calibration_ignores_observation_order(counts, q, sq, rnd):
    shuffled = counts.copy()
    rnd.shuffle(shuffled)
    a, b = calibrate(counts, q, sq), calibrate(shuffled, q, sq)
    assert (a.capacity, a.spill_capacity) == (b.capacity, b.spill_capacity)
    assert a.frac_counts_over_total == b.frac_counts_over_total


@settings(max_examples=100, deadline=None)
@given(_flat_counts, _quantiles)
def test_capacity_matches_brute_force_definition(counts, q):
    assume(counts.size * q % 1 > 1e-6)  # avoid q * n landing on an integer within rounding
    assert calibrate(counts, q).capacity == max(1, _inverse_cdf(counts, q))


def test_calibrate_counts_each_data_group_as_a_step():
    """Traces of 8 ranks' tokens read as 2 data groups of 4 EP ranks."""
    traces = traces_mod.generate_traces(num_steps=4, num_layers=2, tokens_per_rank=8, seed=3)
    grouped = calibrate(traces, 0.9, num_ranks=4, num_experts=8, num_groups=2)
    counts = traces_mod.per_peer_counts(traces, num_ranks=4, num_experts=8, num_groups=2)
    assert counts.shape == (2 * len(traces), 4, 4)
    assert grouped == calibrate(counts, 0.9)
    with pytest.raises(ValueError, match="num_groups: applies to traces only"):
        calibrate(counts, 0.9, num_groups=2)

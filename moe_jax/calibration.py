"""Capacity calibration for cap-and-spill dispatch.

Per (source rank i, destination rank j) and step, cap-and-spill moves up to
``C`` rows in pass 1, up to ``S`` more in the spill pass, and anything
beyond ``C + S`` through an exact fallback.  :func:`calibrate` picks ``C``
and ``S`` from measured per-peer counts and reports how often each pass is
needed.

Rules
-----
* ``C = max(1, ceil(Q_q(counts)))`` where ``Q_q`` is the inverse-CDF
  (``numpy`` ``method="inverted_cdf"``) quantile: the smallest observed
  count ``c`` with ``P(count <= c) >= q``.  Hence the fraction of counts
  above ``C`` is at most ``1 - q``, and ``C`` is non-decreasing in ``q``.
* ``S = max(1, ceil(Q_s(count - C | count > C)))``: the ``spill_quantile``
  quantile of the overflow of the pairs that overflow (``S = 1`` when none
  does).  So at most a fraction ``1 - spill_quantile`` of the overflowing
  pairs needs the fallback, i.e. at most ``(1 - q) * (1 - spill_quantile)``
  of all counts, and ``C + S >= Q_s(counts)`` (the conditional distribution
  dominates the unconditional one).

Rates are reported at three granularities (for ``[N, P, P]`` counts, where
one of the ``N`` entries is one (layer, step)):

* per count: fraction of (step, layer, i, j) observations above a bound;
* per slice: fraction of (step, layer, source rank) dispatch slices in which
  some destination count is above the bound (the Cap-and-Spill paper's
  "dispatch slices": 5.4% at C = 16 for Mixtral-8x7B EP8);
* per step: fraction of (layer, step) dispatches in which some pair is above
  the bound, i.e. in which the spill pass (or the fallback) is needed by
  some rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .traces import RoutingTrace, per_peer_counts

__all__ = ["Calibration", "calibrate", "overflow_rates", "quantile_count"]


@dataclass(frozen=True)
class Calibration:
    """Result of :func:`calibrate`.

    Attributes:
      capacity: ``C`` (int >= 1), pass-1 rows per (source, destination).
      spill_capacity: ``S`` (int >= 1), spill-pass rows per pair.
      quantile, spill_quantile: the quantiles ``C`` and ``S`` came from.
      num_observations: per-peer counts used.
      num_steps: (layer, step) dispatches, or ``None`` for flat counts.
      count_mean, count_sd: mean and population sd (ddof=0) of the counts.
      count_q99: inverse-CDF 0.99 quantile; count_max: the largest count.
      frac_counts_over_capacity: fraction of counts ``> C``.
      frac_counts_over_total: fraction of counts ``> C + S``.
      frac_slices_spill / frac_slices_fallback: fraction of (step, layer,
        source) slices with some count ``> C`` / ``> C + S`` (NaN for flat
        counts).
      frac_steps_spill / frac_steps_fallback: fraction of (layer, step)
        dispatches with some count ``> C`` / ``> C + S`` (NaN for flat
        counts): how often the spill pass / the fallback runs.
    """

    capacity: int
    spill_capacity: int
    quantile: float
    spill_quantile: float
    num_observations: int
    num_steps: int | None
    count_mean: float
    count_sd: float
    count_q99: int
    count_max: int
    frac_counts_over_capacity: float
    frac_counts_over_total: float
    frac_slices_spill: float
    frac_slices_fallback: float
    frac_steps_spill: float
    frac_steps_fallback: float

    @property
    def total_capacity(self) -> int:
        """``C + S``: rows per pair that avoid the fallback."""
        return self.capacity + self.spill_capacity


def _check_quantile(name: str, q: Any) -> float:
    if isinstance(q, (bool, np.bool_)) or not isinstance(q, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name}: must be a number in (0, 1), got {q!r}")
    q = float(q)
    if not 0.0 < q < 1.0:  # also rejects NaN
        raise ValueError(f"{name}: must be in (0, 1), got {q!r}")
    return q


def _check_counts(counts: Any) -> np.ndarray:
    arr = np.asarray(counts)
    if arr.dtype == object or arr.dtype.kind not in "iuf":
        raise ValueError(f"traces_or_counts: counts must be numbers, got dtype {arr.dtype}")
    if arr.ndim not in (1, 3):
        raise ValueError("traces_or_counts: counts must be [num_observations] or "
                         f"[num_steps, P, P], got shape {arr.shape}")
    if arr.ndim == 3 and arr.shape[1] != arr.shape[2]:
        raise ValueError(f"traces_or_counts: counts [num_steps, P, P] need square "
                         f"trailing axes, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("traces_or_counts: no counts")
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all() or (arr != np.floor(arr)).any():
            raise ValueError("traces_or_counts: counts must be whole numbers")
    if (arr < 0).any():
        raise ValueError("traces_or_counts: counts must be >= 0")
    return arr.astype(np.int64)


def quantile_count(counts: np.ndarray, q: float) -> int:
    """Inverse-CDF quantile of non-negative integer counts (``[n]``, n >= 1).

    The smallest observed value ``c`` with ``mean(counts <= c) >= q``.
    """
    q = _check_quantile("q", q)
    counts = np.asarray(counts).reshape(-1)
    if counts.size == 0:
        raise ValueError("counts: empty")
    return int(np.quantile(counts, q, method="inverted_cdf"))


def _group_rates(counts: np.ndarray, bound: int) -> tuple[float, float, float]:
    """(per count, per slice, per step) fractions of ``counts > bound``."""
    over = counts > bound
    per_count = float(over.mean())
    if counts.ndim == 1:
        return per_count, math.nan, math.nan
    per_slice = float(over.any(axis=-1).mean())
    per_step = float(over.any(axis=(-1, -2)).mean())
    return per_count, per_slice, per_step


def overflow_rates(counts: Any, capacity: int, spill_capacity: int = 0) -> dict[str, float]:
    """Overflow rates of given capacities (e.g. C = 16 from the paper).

    Args:
      counts: ``[num_observations]`` or ``[num_steps, P, P]`` per-peer counts.
      capacity: ``C >= 0``; spill_capacity: ``S >= 0``.
    Returns:
      dict with ``counts_over_capacity``, ``slices_over_capacity``,
      ``steps_over_capacity`` (bound ``C``) and ``counts_over_total``,
      ``slices_over_total``, ``steps_over_total`` (bound ``C + S``); the
      slice and step rates are NaN for flat counts.
    """
    for name, v in (("capacity", capacity), ("spill_capacity", spill_capacity)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name}: must be an integer >= 0, got {v!r}")
    arr = _check_counts(counts)
    c1, s1, t1 = _group_rates(arr, int(capacity))
    c2, s2, t2 = _group_rates(arr, int(capacity) + int(spill_capacity))
    return {"counts_over_capacity": c1, "slices_over_capacity": s1, "steps_over_capacity": t1,
            "counts_over_total": c2, "slices_over_total": s2, "steps_over_total": t2}


def _is_trace_input(x: Any) -> bool:
    if isinstance(x, RoutingTrace):
        return True
    if isinstance(x, (np.ndarray, str, bytes)):
        return False
    if isinstance(x, Sequence) and len(x) and all(isinstance(t, RoutingTrace) for t in x):
        return True
    return False


def calibrate(traces_or_counts: Any, quantile: float = 0.99, spill_quantile: float = 0.999, *,
              num_ranks: int | None = None, num_experts: int | None = None,
              num_groups: int = 1, include_self: bool = True) -> Calibration:
    """Chooses cap-and-spill capacities from routing traces or per-peer counts.

    Args:
      traces_or_counts: a :class:`~moe_jax.traces.RoutingTrace` or a
        sequence of them (counted with :func:`~moe_jax.traces.per_peer_counts`),
        or per-peer counts: ``[num_steps, P, P]`` (one entry per (layer,
        step); slice and step rates are reported) or ``[num_observations]``
        (those rates are NaN).  Counts are whole numbers >= 0.
      quantile: ``q`` in (0, 1); ``C = max(1, ceil(Q_q(counts)))``.
      spill_quantile: in (0, 1); ``S = max(1, ceil(Q_s(count - C | count > C)))``.
      num_ranks, num_experts: layout for traces (default: the traces' own);
        for ``[num_steps, P, P]`` counts ``num_ranks`` must equal ``P``.
      num_groups: for traces: the data-parallel groups of ``num_ranks``
        ranks each that the traces' tokens are split over
        (``MoEConfig.data_axes``; see :func:`~moe_jax.traces.per_peer_counts`);
        every group's dispatch is one step.
      include_self: count the self pair ``i == j`` (default; it uses the same
        buffers).  ``False`` needs traces or ``[num_steps, P, P]`` counts.
    Returns:
      a :class:`Calibration`.
    Raises:
      ValueError naming the bad argument.
    """
    quantile = _check_quantile("quantile", quantile)
    spill_quantile = _check_quantile("spill_quantile", spill_quantile)
    if not isinstance(include_self, (bool, np.bool_)):
        raise ValueError(f"include_self: must be a bool, got {include_self!r}")
    for name, v in (("num_ranks", num_ranks), ("num_experts", num_experts)):
        if v is not None and (isinstance(v, (bool, np.bool_)) or
                              not isinstance(v, (int, np.integer)) or v < 1):
            raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")

    if _is_trace_input(traces_or_counts):
        counts = per_peer_counts(traces_or_counts, num_ranks=num_ranks, num_experts=num_experts,
                                 num_groups=num_groups)
    else:
        if isinstance(traces_or_counts, Sequence) and not isinstance(
                traces_or_counts, (str, bytes)) and any(
                isinstance(t, RoutingTrace) for t in traces_or_counts):
            raise ValueError("traces_or_counts: mixes RoutingTrace objects with other values")
        if num_groups != 1:
            raise ValueError(f"num_groups: applies to traces only (counts are already per "
                             f"group), got {num_groups!r}")
        counts = _check_counts(traces_or_counts)
        if num_ranks is not None and counts.ndim == 3 and counts.shape[1] != num_ranks:
            raise ValueError(f"num_ranks: {num_ranks} does not match counts of shape "
                             f"{counts.shape}")
        if num_experts is not None and num_ranks is not None and num_experts % num_ranks:
            raise ValueError(f"num_experts: {num_experts} is not a multiple of "
                             f"num_ranks={num_ranks}")

    if include_self:
        obs = counts.reshape(-1)
        grouped = counts
    else:
        if counts.ndim != 3:
            raise ValueError("include_self: False needs traces or [num_steps, P, P] counts")
        P = counts.shape[1]
        if P < 2:
            raise ValueError("include_self: False leaves no pairs with a single rank")
        off = ~np.eye(P, dtype=bool)
        obs = counts[:, off]
        # Off-diagonal pairs grouped by source rank: [N, P, P - 1].
        grouped = counts[:, off].reshape(counts.shape[0], P, P - 1)

    capacity = max(1, int(math.ceil(np.quantile(obs, quantile, method="inverted_cdf"))))
    excess = obs[obs > capacity] - capacity
    if excess.size:
        spill = max(1, int(math.ceil(np.quantile(excess, spill_quantile, method="inverted_cdf"))))
    else:
        spill = 1
    c1, s1, t1 = _group_rates(grouped, capacity)
    c2, s2, t2 = _group_rates(grouped, capacity + spill)
    return Calibration(
        capacity=capacity,
        spill_capacity=spill,
        quantile=quantile,
        spill_quantile=spill_quantile,
        num_observations=int(obs.size),
        num_steps=int(counts.shape[0]) if counts.ndim == 3 else None,
        count_mean=float(obs.mean()),
        count_sd=float(obs.std()),
        count_q99=int(np.quantile(obs, 0.99, method="inverted_cdf")),
        count_max=int(obs.max()),
        frac_counts_over_capacity=c1,
        frac_counts_over_total=c2,
        frac_slices_spill=s1,
        frac_slices_fallback=s2,
        frac_steps_spill=t1,
        frac_steps_fallback=t2,
    )

"""Routing traces: a record type, a calibrated generator, per-peer counts, JSONL I/O.

A *routing trace* records, for one MoE layer at one step (one forward call),
which experts every token was routed to and with which weights.

Rank layout
-----------
Expert parallelism over ``P = num_ranks`` ranks with ``E = num_experts``
experts (``E % P == 0``): expert ``e`` lives on rank ``e // (E // P)``.
The ``T`` tokens of a trace are the tokens of *all* ranks at that step.
By default (``source_rank is None``) they are split into ``P`` equal
contiguous shards: token ``t`` lives on rank ``t // (T // P)``, which needs
``T % P == 0``.  A trace may instead carry an explicit ``source_rank [T]``
array (any assignment of tokens to ranks, e.g. ranks with unequal token
counts).  A per-peer count ``c[i, j]`` is the number of (token, k-slot)
rows that source rank ``i`` sends to destination rank ``j``; the self pair
``i == j`` is included (it goes through the same capacity-bounded buffers).

Generative model (:func:`generate_traces`, :class:`TraceModel`)
-----------------------------------------------------------------
* Tokens per rank at step ``s`` (the same on every rank and every layer of
  the step): a fraction ``prefill_prob`` of the steps (their number fixed,
  their positions random) are prefill-like steps with
  ``Uniform{prefill_min_tokens .. prefill_max_tokens}`` tokens; the others
  are decode-like steps with ``decode_base_tokens +
  Poisson(decode_extra_tokens_mean)`` tokens.  A fixed ``tokens_per_rank``
  (e.g. for benchmarks: T tokens per GPU, fresh routing every step)
  replaces this distribution.
* Expert popularity per (layer, step): biases ``b_e = skew * N(0, 1)``
  (i.i.d. over experts, fresh for every layer and step), i.e. lognormal
  popularity weights ``exp(b_e)``.  ``skew = 0`` is uniform routing.
* Per token: router logits ``b_e + g_te`` with ``g_te ~ Gumbel(0, 1)``;
  the token takes the top-``k`` logits (distinct experts, ordered by
  decreasing logit).  This is sampling ``k`` experts without replacement
  with probabilities proportional to ``exp(b_e)`` (Plackett-Luce).  Gating
  weights are the softmax of the selected logits (renormalized top-k).

The defaults (:func:`mixtral_8x7b_ep8`) were fitted by simulation so that
Mixtral-8x7B EP8 statistics (E = 8, P = 8, top-2, 32 layers x 1000 steps,
2,048,000 per-peer observations) are reproduced: per-peer count mean 5.1,
sd 3.6, Q99 16, max 43, and 5.4% of (step, layer, source-rank) dispatch
slices having some peer count above C = 16 (see ``MIXTRAL_8X7B_EP8_TARGETS``).
With ``seed=0`` the generator gives mean 5.10, sd 3.59, Q99 16, max 43 and
5.43% of slices above 16 (0.86% of counts, 12.3% of (layer, step)
dispatches); over seeds 0-11, Q99 is always 16 and the max lies in 40-46.
Why these parameters: the mean fixes the mean token count (5.1 * P / k =
20.4 tokens per rank); a count can't exceed the rank's token count, so a
max of 43 needs a few steps with more than 43 tokens (the prefill-like
steps, capped at 48 tokens); ``skew`` then sets the overdispersion (sd 3.6
against a binomial's 1.9 at T = 20) and, together with the prefill
fraction, Q99 and the slice overflow rate.  Generating the default 32,000
traces takes about 1.2 s (2-core machine).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MIXTRAL_8X7B_EP8_TARGETS",
    "RoutingTrace",
    "TraceModel",
    "generate_traces",
    "load_jsonl",
    "mixtral_8x7b_ep8",
    "per_peer_counts",
    "sample_routing",
    "save_jsonl",
]

#: Published per-peer count statistics the default preset is fitted to
#: (Cap-and-Spill paper, Mixtral-8x7B, EP8, one expert per GPU, top-2).
#: ``slice_overflow_at_16``: fraction of (step, layer, source rank) dispatch
#: slices in which some (source, destination) count exceeds C = 16.
MIXTRAL_8X7B_EP8_TARGETS = {
    "mean": 5.1,
    "sd": 3.6,
    "q99": 16,
    "max": 43,
    "slice_overflow_at_16": 0.054,
}

_GATING_SUM_TOL = 1e-3


# --------------------------------------------------------------------------
# The record type
# --------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_layout(num_ranks: Any, num_experts: Any) -> None:
    if not _is_int(num_ranks) or num_ranks < 1:
        raise ValueError(f"num_ranks: must be an integer >= 1, got {num_ranks!r}")
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts: must be an integer >= 1, got {num_experts!r}")
    if num_experts % num_ranks:
        raise ValueError(
            f"num_experts: {num_experts} is not a multiple of num_ranks={num_ranks}")


def _as_int_array(name: str, value: Any, dtype: Any, ndim: int) -> np.ndarray:
    """Converts ``value`` to an integer array of ``dtype`` without silent changes."""
    arr = np.asarray(value)
    if arr.size == 0 and arr.dtype.kind not in "iu":
        arr = arr.astype(dtype)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: must contain integers, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name}: must be {ndim}-D, got shape {arr.shape}")
    out = arr.astype(dtype, copy=False)
    if arr.size and not np.array_equal(out, arr):
        raise ValueError(f"{name}: values do not fit in {np.dtype(dtype).name}")
    return out


def _as_float32(name: str, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.size == 0 and arr.dtype.kind not in "fiu":
        arr = arr.astype(np.float32)
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"{name}: must contain numbers, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{name}: must be 2-D [T, k], got shape {arr.shape}")
    return arr.astype(np.float32, copy=False)


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """Routing of one MoE layer at one step, for the tokens of all ranks.

    Attributes:
      layer: layer index (>= 0).
      experts: ``[T, k]`` int32, the distinct experts of each token in
        ``[0, num_experts)``, in the router's order (highest weight first
        for generated traces).
      gating_probs: ``[T, k]`` float32, renormalized top-k weights (finite,
        >= 0, each row sums to 1 within 1e-3).
      token_idx: ``[T]`` int64, distinct global token ids (>= 0); the same
        token keeps its id across the layers of a step.
      num_ranks: ``P``, ranks of the expert-parallel group.
      num_experts: ``E``, a multiple of ``P``; expert ``e`` lives on rank
        ``e // (E // P)``.
      step: step index (>= 0).
      source_rank: ``None`` (the default: ``P`` equal contiguous shards,
        needs ``T % P == 0``) or ``[T]`` int32 in ``[0, P)``: the rank each
        token lives on.

    The constructor converts array arguments to the dtypes above and
    validates everything, raising ``ValueError`` that names the field.
    Equality (``==``) is bitwise on all fields.
    """

    layer: int
    experts: np.ndarray
    gating_probs: np.ndarray
    token_idx: np.ndarray
    num_ranks: int = 8
    num_experts: int = 8
    step: int = 0
    source_rank: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in ("layer", "step"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {v!r}")
            object.__setattr__(self, name, int(v))
        _check_layout(self.num_ranks, self.num_experts)
        object.__setattr__(self, "num_ranks", int(self.num_ranks))
        object.__setattr__(self, "num_experts", int(self.num_experts))

        experts = _as_int_array("experts", self.experts, np.int32, 2)
        gating = _as_float32("gating_probs", self.gating_probs)
        token_idx = _as_int_array("token_idx", self.token_idx, np.int64, 1)
        num_tokens, top_k = experts.shape
        if top_k < 1:
            raise ValueError(f"experts: top_k must be >= 1, got shape {experts.shape}")
        if gating.shape != experts.shape:
            raise ValueError(f"gating_probs: shape {gating.shape} differs from "
                             f"experts shape {experts.shape}")
        if token_idx.shape != (num_tokens,):
            raise ValueError(f"token_idx: shape {token_idx.shape}, expected ({num_tokens},)")
        if top_k > self.num_experts:
            raise ValueError(f"experts: top_k={top_k} exceeds num_experts={self.num_experts}")
        if num_tokens:
            if experts.min() < 0 or experts.max() >= self.num_experts:
                raise ValueError(f"experts: ids must lie in [0, {self.num_experts}), got "
                                 f"[{experts.min()}, {experts.max()}]")
            if top_k > 1 and (np.diff(np.sort(experts, axis=1), axis=1) == 0).any():
                row = int(np.nonzero((np.diff(np.sort(experts, axis=1), axis=1) == 0)
                                     .any(axis=1))[0][0])
                raise ValueError(f"experts: token {row} lists an expert twice: "
                                 f"{experts[row].tolist()}")
            if not np.isfinite(gating).all() or (gating < 0).any():
                raise ValueError("gating_probs: must be finite and >= 0")
            sums = gating.sum(axis=1, dtype=np.float64)
            bad = np.abs(sums - 1.0) > _GATING_SUM_TOL
            if bad.any():
                row = int(np.nonzero(bad)[0][0])
                raise ValueError(f"gating_probs: row {row} sums to {sums[row]:.6g}, "
                                 "expected 1 (renormalized top-k weights)")
            if token_idx.min() < 0:
                raise ValueError("token_idx: ids must be >= 0")
            if np.unique(token_idx).size != num_tokens:
                raise ValueError("token_idx: ids must be distinct within a trace")
        if self.source_rank is None:
            if num_tokens % self.num_ranks:
                raise ValueError(
                    f"source_rank: required when the token count {num_tokens} is not a "
                    f"multiple of num_ranks={self.num_ranks} (equal contiguous shards)")
            source_rank = None
        else:
            source_rank = _as_int_array("source_rank", self.source_rank, np.int32, 1)
            if source_rank.shape != (num_tokens,):
                raise ValueError(f"source_rank: shape {source_rank.shape}, "
                                 f"expected ({num_tokens},)")
            if num_tokens and (source_rank.min() < 0 or source_rank.max() >= self.num_ranks):
                raise ValueError(f"source_rank: ranks must lie in [0, {self.num_ranks})")
        object.__setattr__(self, "experts", experts)
        object.__setattr__(self, "gating_probs", gating)
        object.__setattr__(self, "token_idx", token_idx)
        object.__setattr__(self, "source_rank", source_rank)

    @classmethod
    def _trusted(cls, layer: int, experts: np.ndarray, gating_probs: np.ndarray,
                 token_idx: np.ndarray, num_ranks: int, num_experts: int,
                 step: int) -> "RoutingTrace":
        """Builds a trace from arrays known to be valid (no checks; generator use)."""
        obj = object.__new__(cls)
        for name, value in (("layer", layer), ("experts", experts),
                            ("gating_probs", gating_probs), ("token_idx", token_idx),
                            ("num_ranks", num_ranks), ("num_experts", num_experts),
                            ("step", step), ("source_rank", None)):
            object.__setattr__(obj, name, value)
        return obj

    @property
    def num_tokens(self) -> int:
        """``T``, tokens of all ranks in this trace."""
        return int(self.experts.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[1])

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    def source_ranks(self) -> np.ndarray:
        """``[T]`` int32: the rank each token lives on."""
        if self.source_rank is not None:
            return self.source_rank
        shard = self.num_tokens // self.num_ranks
        return np.repeat(np.arange(self.num_ranks, dtype=np.int32), shard)

    def dest_ranks(self) -> np.ndarray:
        """``[T, k]`` int32: the rank each (token, slot) row is sent to."""
        return (self.experts // self.experts_per_rank).astype(np.int32)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingTrace):
            return NotImplemented
        if (self.layer, self.step, self.num_ranks, self.num_experts) != (
                other.layer, other.step, other.num_ranks, other.num_experts):
            return False
        for a, b in ((self.experts, other.experts), (self.token_idx, other.token_idx)):
            if a.dtype != b.dtype or not np.array_equal(a, b):
                return False
        g, h = self.gating_probs, other.gating_probs
        if g.shape != h.shape or not np.array_equal(g.view(np.uint32), h.view(np.uint32)):
            return False
        if (self.source_rank is None) != (other.source_rank is None):
            return False
        return self.source_rank is None or np.array_equal(self.source_rank, other.source_rank)

    __hash__ = None  # type: ignore[assignment]

    def to_json_dict(self) -> dict:
        """The JSONL record of this trace (see :func:`save_jsonl`)."""
        rec = {
            "layer": self.layer,
            "step": self.step,
            "num_ranks": self.num_ranks,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "experts": self.experts.tolist(),
            # float32 -> Python float is exact; json writes the shortest
            # decimal that reads back as the same double, hence the same float32.
            "gating_probs": self.gating_probs.tolist(),
            "token_idx": self.token_idx.tolist(),
        }
        if self.source_rank is not None:
            rec["source_rank"] = self.source_rank.tolist()
        return rec


# --------------------------------------------------------------------------
# The generative model
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceModel:
    """Parameters of the trace generator (see the module docstring).

    The defaults are the fitted Mixtral-8x7B EP8 preset.  Token counts are
    per rank per step; ``skew`` is the standard deviation of the
    per-(layer, step) expert log-popularity.
    """

    num_experts: int = 8
    num_ranks: int = 8
    top_k: int = 2
    num_layers: int = 32
    num_steps: int = 1000
    skew: float = 0.675
    decode_base_tokens: int = 16
    decode_extra_tokens_mean: float = 3.6
    prefill_prob: float = 0.04
    prefill_min_tokens: int = 32
    prefill_max_tokens: int = 48

    def __post_init__(self) -> None:
        _check_layout(self.num_ranks, self.num_experts)
        if not _is_int(self.top_k) or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k: must be an integer in [1, num_experts], got {self.top_k!r}")
        for name in ("num_layers", "num_steps"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        if not (isinstance(self.skew, (int, float, np.floating)) and math.isfinite(self.skew)
                and self.skew >= 0):
            raise ValueError(f"skew: must be a finite number >= 0, got {self.skew!r}")
        if not _is_int(self.decode_base_tokens) or self.decode_base_tokens < 0:
            raise ValueError("decode_base_tokens: must be an integer >= 0, "
                             f"got {self.decode_base_tokens!r}")
        m = self.decode_extra_tokens_mean
        if not (isinstance(m, (int, float, np.floating)) and math.isfinite(m) and m >= 0):
            raise ValueError(f"decode_extra_tokens_mean: must be a finite number >= 0, got {m!r}")
        if self.decode_base_tokens == 0 and m == 0:
            raise ValueError("decode_base_tokens: decode steps would have no tokens")
        p = self.prefill_prob
        if not (isinstance(p, (int, float, np.floating)) and 0 <= p <= 1):
            raise ValueError(f"prefill_prob: must be in [0, 1], got {p!r}")
        lo, hi = self.prefill_min_tokens, self.prefill_max_tokens
        if not _is_int(lo) or lo < 1:
            raise ValueError(f"prefill_min_tokens: must be an integer >= 1, got {lo!r}")
        if not _is_int(hi) or hi < lo:
            raise ValueError(f"prefill_max_tokens: must be an integer >= prefill_min_tokens, "
                             f"got {hi!r}")

    def replace(self, **changes: Any) -> "TraceModel":
        return dataclasses.replace(self, **changes)

    def mean_tokens_per_rank(self) -> float:
        """Expected tokens per rank per step (decode steps clipped to >= 1)."""
        lam = float(self.decode_extra_tokens_mean)
        decode = self.decode_base_tokens + lam
        if self.decode_base_tokens == 0:  # Poisson conditioned on >= 1 via clipping
            decode += math.exp(-lam)
        prefill = 0.5 * (self.prefill_min_tokens + self.prefill_max_tokens)
        return (1 - self.prefill_prob) * decode + self.prefill_prob * prefill

    def expected_count_mean(self) -> float:
        """Expected per-peer count: ``mean_tokens_per_rank * top_k / num_ranks``."""
        return self.mean_tokens_per_rank() * self.top_k / self.num_ranks

    def sample_tokens_per_rank(self, num_steps: int, rng: np.random.Generator) -> np.ndarray:
        """``[num_steps]`` int64 tokens per rank, one value per step (all >= 1).

        Exactly ``floor(prefill_prob * num_steps)`` steps, plus one more with
        probability equal to the fractional part, are prefill-like; they sit
        at uniformly random positions.  (Fixing their number rather than
        flipping a coin per step keeps the tail statistics, which the
        prefill-like steps dominate, stable from seed to seed.)
        """
        expected = self.prefill_prob * num_steps
        num_prefill = int(math.floor(expected))
        num_prefill += int(rng.random() < expected - num_prefill)
        is_prefill = np.zeros(num_steps, dtype=bool)
        is_prefill[rng.permutation(num_steps)[:num_prefill]] = True
        decode = self.decode_base_tokens + rng.poisson(self.decode_extra_tokens_mean, num_steps)
        prefill = rng.integers(self.prefill_min_tokens, self.prefill_max_tokens + 1, num_steps)
        return np.maximum(np.where(is_prefill, prefill, decode), 1).astype(np.int64)

    def generate(self, seed: int = 0, *, tokens_per_rank: Any = None) -> list[RoutingTrace]:
        """:func:`generate_traces` with these parameters."""
        return generate_traces(**dataclasses.asdict(self), tokens_per_rank=tokens_per_rank,
                               seed=seed)


def mixtral_8x7b_ep8(**overrides: Any) -> TraceModel:
    """The fitted Mixtral-8x7B EP8 preset (E=8, P=8, top-2, 32 layers x 1000 steps).

    Fitted values: ``skew=0.675``; tokens per rank per step: decode steps
    ``16 + Poisson(3.6)``, prefill-like steps (probability 0.04)
    ``Uniform{32..48}``; mean 20.42 tokens per rank, i.e. a per-peer count
    mean of 5.10.  ``overrides`` replace fields (e.g. ``num_steps=100``).
    """
    return TraceModel(**overrides)


_PRESET = TraceModel()
_CHUNK_ELEMENTS = 1 << 22  # Gumbel draws per chunk (bounds memory for large E)


def _route_chunk(rng: np.random.Generator, bias: np.ndarray, top_k: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Top-k routing of the tokens of one chunk.

    ``bias``: ``[N, E]`` float32 per-token copy of the popularity logits.
    Returns experts ``[N, k]`` int32 (by decreasing logit) and gating
    ``[N, k]`` float32 (softmax over the k selected logits).
    """
    n, num_experts = bias.shape
    u = rng.random((n, num_experts), dtype=np.float32)
    np.maximum(u, np.float32(1e-30), out=u)
    # logits = bias + Gumbel(0, 1) = bias - log(-log(u))
    logits = np.log(u, out=u)
    np.negative(logits, out=logits)
    np.log(logits, out=logits)
    np.subtract(bias, logits, out=logits)
    if top_k == num_experts:
        top = np.broadcast_to(np.arange(num_experts), (n, num_experts))
    else:
        top = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
    vals = np.take_along_axis(logits, top, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    experts = np.take_along_axis(top, order, axis=1).astype(np.int32)
    vals = np.take_along_axis(vals, order, axis=1)
    w = np.exp(vals - vals[:, :1])
    w /= w.sum(axis=1, keepdims=True)
    return experts, w.astype(np.float32)


def sample_routing(rng: np.random.Generator, num_tokens: int, num_experts: int = 8,
                   top_k: int = 2, skew: float = _PRESET.skew,
                   bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Routes ``num_tokens`` tokens that share one popularity draw (one layer, one step).

    Args:
      rng: numpy Generator (advanced in place).
      num_tokens: ``N``, tokens of all ranks together.
      num_experts, top_k: ``E`` and ``k``.
      skew: std of the expert log-popularity, drawn fresh here unless
        ``bias`` is given.
      bias: optional ``[E]`` popularity logits to use instead.
    Returns:
      ``experts [N, k] int32`` (distinct per row, decreasing logit) and
      ``gating_probs [N, k] float32`` (rows sum to 1).
    """
    if not _is_int(num_tokens) or num_tokens < 0:
        raise ValueError(f"num_tokens: must be an integer >= 0, got {num_tokens!r}")
    if not _is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: must be an integer in [1, num_experts], got {top_k!r}")
    if bias is None:
        bias = skew * rng.standard_normal(num_experts)
    bias = np.asarray(bias, dtype=np.float32)
    if bias.shape != (num_experts,):
        raise ValueError(f"bias: shape {bias.shape}, expected ({num_experts},)")
    return _route_chunk(rng, np.broadcast_to(bias, (num_tokens, num_experts)), top_k)


def generate_traces(num_experts: int = 8, num_ranks: int = 8, top_k: int = 2,
                    num_layers: int = 32, num_steps: int = 1000,
                    tokens_per_rank: int | Sequence[int] | np.ndarray | None = None,
                    skew: float = _PRESET.skew, seed: int = 0, *,
                    decode_base_tokens: int = _PRESET.decode_base_tokens,
                    decode_extra_tokens_mean: float = _PRESET.decode_extra_tokens_mean,
                    prefill_prob: float = _PRESET.prefill_prob,
                    prefill_min_tokens: int = _PRESET.prefill_min_tokens,
                    prefill_max_tokens: int = _PRESET.prefill_max_tokens,
                    ) -> list[RoutingTrace]:
    """Synthetic routing traces; defaults are the fitted Mixtral-8x7B EP8 preset.

    Args:
      num_experts, num_ranks, top_k: ``E``, ``P`` (``E % P == 0``), ``k``.
      num_layers, num_steps: traces are generated for every (step, layer).
      tokens_per_rank: ``None`` draws tokens per rank for each step from the
        decode/prefill mixture (``decode_*``, ``prefill_*`` arguments); an
        int ``T >= 1`` fixes it for every step; a ``[num_steps]`` sequence
        of ints >= 1 gives it per step.
      skew: std of the per-(layer, step) expert log-popularity (0: uniform).
      seed: the result is a deterministic function of all arguments.
    Returns:
      ``num_steps * num_layers`` traces in step-major order (``traces[s *
      num_layers + l]`` is step ``s``, layer ``l``), each with ``P * T_s``
      tokens in equal contiguous shards (``source_rank=None``) and global
      token ids ``sum_{s' < s} P * T_s' + arange(P * T_s)`` shared by the
      layers of a step.

    Takes about 1-2 s for the default 1000 steps x 32 layers.
    """
    model = TraceModel(num_experts=num_experts, num_ranks=num_ranks, top_k=top_k,
                       num_layers=num_layers, num_steps=num_steps, skew=skew,
                       decode_base_tokens=decode_base_tokens,
                       decode_extra_tokens_mean=decode_extra_tokens_mean,
                       prefill_prob=prefill_prob, prefill_min_tokens=prefill_min_tokens,
                       prefill_max_tokens=prefill_max_tokens)
    if not _is_int(seed):
        raise ValueError(f"seed: must be an integer, got {seed!r}")
    rng = np.random.default_rng(seed)
    if tokens_per_rank is None:
        tps = model.sample_tokens_per_rank(num_steps, rng)
    elif _is_int(tokens_per_rank):
        if tokens_per_rank < 1:
            raise ValueError(f"tokens_per_rank: must be >= 1, got {tokens_per_rank!r}")
        tps = np.full(num_steps, int(tokens_per_rank), np.int64)
    else:
        try:
            tps = _as_int_array("tokens_per_rank", tokens_per_rank, np.int64, 1)
        except ValueError as exc:
            raise ValueError(f"tokens_per_rank: must be None, an int or [num_steps] ints "
                             f"({exc})") from None
        if tps.shape != (num_steps,) or (tps < 1).any():
            raise ValueError(f"tokens_per_rank: need {num_steps} values >= 1, got shape "
                             f"{tps.shape}")

    step_tokens = num_ranks * tps                       # [S] tokens of all ranks
    step_start = np.concatenate([[0], np.cumsum(step_tokens)])
    total = int(step_start[-1])
    all_token_ids = np.arange(total, dtype=np.int64)

    # Chunks of whole steps with at most _CHUNK_ELEMENTS Gumbel draws.
    chunks: list[tuple[int, int]] = []
    s0 = 0
    while s0 < num_steps:
        s1 = s0 + 1
        while (s1 < num_steps and
               (step_start[s1 + 1] - step_start[s0]) * num_experts <= _CHUNK_ELEMENTS):
            s1 += 1
        chunks.append((s0, s1))
        s0 = s1

    out: list[RoutingTrace | None] = [None] * (num_steps * num_layers)
    for s0, s1 in chunks:
        base = int(step_start[s0])
        counts = step_tokens[s0:s1]
        step_of_token = np.repeat(np.arange(s1 - s0), counts)
        for layer in range(num_layers):
            bias = (skew * rng.standard_normal((s1 - s0, num_experts))).astype(np.float32)
            experts, gating = _route_chunk(rng, bias[step_of_token], top_k)
            for s in range(s0, s1):
                a, b = int(step_start[s]) - base, int(step_start[s + 1]) - base
                out[s * num_layers + layer] = RoutingTrace._trusted(
                    layer, experts[a:b], gating[a:b], all_token_ids[base + a:base + b],
                    num_ranks, num_experts, s)
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------
# Per-peer counts
# --------------------------------------------------------------------------


def per_peer_counts(traces: RoutingTrace | Iterable[RoutingTrace], *,
                    num_ranks: int | None = None,
                    num_experts: int | None = None,
                    num_groups: int = 1) -> np.ndarray:
    """Rows sent from each source rank to each destination rank.

    Args:
      traces: one trace or a sequence of ``N`` traces (all with the same
        ``num_ranks`` / ``num_experts`` unless overridden).
      num_ranks, num_experts: override the layout stored in the traces.
      num_groups: ``G`` data-parallel groups of ``P`` ranks each
        (``MoEConfig.data_axes``): a trace's tokens lie in ``G * P`` equal
        contiguous shards, group-major (group ``g``, rank ``r`` holds shard
        ``g * P + r``), and each group dispatches among its own ``P`` ranks.
        Needs traces without ``source_rank``.
    Returns:
      ``[N * G, P, P]`` int64: ``counts[n * G + g, i, j]`` is the number of
      (token, k-slot) rows of trace ``n`` whose token lives on rank ``i`` of
      group ``g`` and whose expert lives on rank ``j = e // (E // P)`` (of
      that group).  ``counts.reshape(-1)`` gives the per-peer observations
      (self pairs included; ``counts[:, ~np.eye(P, dtype=bool)]`` drops
      them).
    """
    if isinstance(traces, RoutingTrace):
        traces = [traces]
    traces = list(traces)
    if not traces:
        raise ValueError("traces: empty")
    for n, tr in enumerate(traces):
        if not isinstance(tr, RoutingTrace):
            raise ValueError(f"traces: element {n} is a {type(tr).__name__}, not a RoutingTrace")
    P = traces[0].num_ranks if num_ranks is None else num_ranks
    E = traces[0].num_experts if num_experts is None else num_experts
    _check_layout(P, E)
    if num_ranks is None and any(t.num_ranks != P for t in traces):
        raise ValueError("num_ranks: traces disagree on num_ranks; pass num_ranks")
    if num_experts is None and any(t.num_experts != E for t in traces):
        raise ValueError("num_experts: traces disagree on num_experts; pass num_experts")
    if not _is_int(num_groups) or num_groups < 1:
        raise ValueError(f"num_groups: must be an integer >= 1, got {num_groups!r}")
    G = int(num_groups)
    if G > 1 and any(t.source_rank is not None for t in traces):
        raise ValueError("num_groups: > 1 needs traces without source_rank (tokens in "
                         "G * P contiguous shards)")
    per_rank = E // P
    S = G * P  # source shards of a trace

    n = len(traces)
    experts = np.concatenate([t.experts.reshape(-1) for t in traces])
    if experts.size and experts.max() >= E:
        raise ValueError(f"num_experts: an expert id {experts.max()} is >= {E}")
    itype = np.int32 if n * S * P < 2**31 else np.int64
    if all(t.source_rank is None for t in traces):
        if any(t.num_tokens % S for t in traces):
            name = "num_groups" if G > 1 else "num_ranks"
            raise ValueError(f"{name}: a trace's token count is not a multiple of {S}")
        # Rows of trace n come in S contiguous runs of (T_n / S) * k rows,
        # run s from source shard s: label each row with n * S + s.
        rows_per_shard = np.array([t.experts.size // S for t in traces], dtype=np.int64)
        pair = np.repeat(np.arange(n * S, dtype=itype), np.repeat(rows_per_shard, S))
    else:
        parts = []
        for m, t in enumerate(traces):
            if t.source_rank is None:
                if t.num_tokens % P:
                    raise ValueError(f"num_ranks: trace {m}'s token count is not a multiple "
                                     f"of {P}")
                s = np.repeat(np.arange(P, dtype=itype), t.num_tokens // P)
            else:
                s = t.source_rank.astype(itype)
            if s.size and s.max() >= P:
                raise ValueError(f"num_ranks: a source_rank is >= {P}")
            parts.append(np.repeat(s + itype(m * P), t.top_k))
        pair = np.concatenate(parts)
    key = pair * itype(P)
    key += (experts // per_rank).astype(itype, copy=False)
    return np.bincount(key, minlength=n * S * P).reshape(n * G, P, P)


# --------------------------------------------------------------------------
# JSONL I/O
# --------------------------------------------------------------------------

_REQUIRED = ("layer", "experts", "gating_probs", "token_idx")


def save_jsonl(traces: RoutingTrace | Iterable[RoutingTrace], path: str | os.PathLike) -> None:
    """Writes one JSON record per trace and line.

    Record fields: ``layer``, ``step``, ``num_ranks``, ``num_experts``,
    ``top_k`` (ints), ``experts`` ``[[e, ...], ...]``, ``gating_probs``
    ``[[w, ...], ...]``, ``token_idx`` ``[t, ...]`` and, only for traces
    that have one, ``source_rank`` ``[r, ...]``.  Gating weights are written
    as the shortest decimals that read back to the same float32, so
    :func:`load_jsonl` returns bitwise-equal traces.
    """
    if isinstance(traces, RoutingTrace):
        traces = [traces]
    with open(path, "w", encoding="utf-8") as f:
        for tr in traces:
            if not isinstance(tr, RoutingTrace):
                raise ValueError(f"traces: got a {type(tr).__name__}, not a RoutingTrace")
            f.write(json.dumps(tr.to_json_dict(), separators=(",", ":")))
            f.write("\n")


def _nested_array(name: str, value: Any, ndim: int, kind: str) -> np.ndarray:
    """JSON value -> numpy array of rank ``ndim``; ``kind`` 'i' (ints) or 'f' (numbers)."""
    def bad(msg: str) -> ValueError:
        return ValueError(f"{name}: {msg}")

    if not isinstance(value, list):
        raise bad(f"must be a {'list of lists' if ndim == 2 else 'list'}, "
                  f"got {type(value).__name__}")
    if ndim == 2:
        for r, row in enumerate(value):
            if not isinstance(row, list):
                raise bad(f"row {r} is a {type(row).__name__}, not a list")
        widths = {len(row) for row in value}
        if len(widths) > 1:
            raise bad(f"rows have different lengths {sorted(widths)}")
        flat = [x for row in value for x in row]
    else:
        flat = value
    for x in flat:
        if isinstance(x, bool) or not isinstance(x, (int, float) if kind == "f" else int):
            raise bad(f"must contain {'numbers' if kind == 'f' else 'integers'}, "
                      f"found {x!r}")
    try:
        arr = np.array(value, dtype=np.float64 if kind == "f" else np.int64)
    except OverflowError:
        raise bad("an integer is out of range") from None
    if ndim == 2 and arr.ndim == 1:  # [] -> [0, k]; k supplied by the caller
        arr = arr.reshape(0, 0)
    return arr


def _record_to_trace(rec: Any, num_ranks: int | None, num_experts: int | None,
                     step_counter: dict[int, int]) -> RoutingTrace:
    if not isinstance(rec, dict):
        raise ValueError(f"record: must be a JSON object, got {type(rec).__name__}")
    for name in _REQUIRED:
        if name not in rec:
            raise ValueError(f"{name}: missing")
    ints: dict[str, int | None] = {}
    for name in ("layer", "step", "num_ranks", "num_experts", "top_k"):
        v = rec.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"{name}: must be an integer, got {v!r}")
        ints[name] = v
    for name, arg in (("num_ranks", num_ranks), ("num_experts", num_experts)):
        if arg is not None and ints[name] is not None and ints[name] != arg:
            raise ValueError(f"{name}: record says {ints[name]}, load_jsonl was given {arg}")
        if ints[name] is None:
            ints[name] = arg if arg is not None else getattr(_PRESET, name)
    layer = ints["layer"]
    if layer is None or layer < 0:  # type: ignore[operator]
        raise ValueError(f"layer: must be an integer >= 0, got {layer!r}")
    step = ints["step"]
    if step is None:
        step = step_counter.get(layer, 0)  # type: ignore[arg-type]
    step_counter[layer] = step + 1  # type: ignore[index,operator]

    experts = _nested_array("experts", rec["experts"], 2, "i")
    gating = _nested_array("gating_probs", rec["gating_probs"], 2, "f")
    token_idx = _nested_array("token_idx", rec["token_idx"], 1, "i")
    top_k = ints["top_k"]
    if experts.shape[0] == 0:
        if top_k is None:
            raise ValueError("top_k: required when a record has no tokens")
        experts = experts.reshape(0, top_k)
        if gating.size == 0:
            gating = gating.reshape(0, top_k)
    elif top_k is not None and experts.shape[1] != top_k:
        raise ValueError(f"top_k: record says {top_k}, experts rows have {experts.shape[1]}")
    gating32 = gating.astype(np.float32)  # doubles from other writers are rounded
    source_rank = None
    if rec.get("source_rank") is not None:
        source_rank = _nested_array("source_rank", rec["source_rank"], 1, "i")
    return RoutingTrace(layer=layer, experts=experts, gating_probs=gating32,  # type: ignore[arg-type]
                        token_idx=token_idx, num_ranks=ints["num_ranks"],  # type: ignore[arg-type]
                        num_experts=ints["num_experts"], step=step,  # type: ignore[arg-type]
                        source_rank=source_rank)


def load_jsonl(path: str | os.PathLike, *, num_ranks: int | None = None,
               num_experts: int | None = None) -> list[RoutingTrace]:
    """Reads traces written by :func:`save_jsonl` (or by hand), validating each line.

    Each non-blank line is a JSON object with the required fields
    ``layer`` (int >= 0), ``experts`` (``[T][k]`` ints), ``gating_probs``
    (``[T][k]`` numbers, rows summing to 1) and ``token_idx`` (``[T]``
    distinct ints >= 0), and the optional fields ``step`` (default: the
    number of earlier records of the same layer), ``num_ranks`` /
    ``num_experts`` (default: the arguments, else 8 / 8), ``top_k`` (needed
    only when ``T == 0``) and ``source_rank`` (``[T]`` ints; default equal
    contiguous shards).  Unknown fields are ignored.

    Raises:
      ValueError: ``"<path> line <n>: <field>: <problem>"`` for the first
        bad line (1-based physical line numbers).
    """
    if num_ranks is not None or num_experts is not None:
        _check_layout(num_ranks if num_ranks is not None else 1,
                      num_experts if num_experts is not None
                      else (num_ranks if num_ranks is not None else 1))
    traces: list[RoutingTrace] = []
    step_counter: dict[int, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"json: not valid JSON ({exc.msg} at column {exc.colno})"
                                     ) from None
                traces.append(_record_to_trace(rec, num_ranks, num_experts, step_counter))
            except ValueError as exc:
                raise ValueError(f"{os.fspath(path)} line {lineno}: {exc}") from None
    return traces

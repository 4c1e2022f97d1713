"""Hot-expert replication: where experts live, and where each pick goes.

``E`` logical experts live on ``P`` ranks x ``S`` physical slots per rank
(``S >= E / P``). A :class:`Placement` says which logical expert each slot
holds (``slot_expert [P, S]``); an expert may sit on several ranks (its
*replicas*). This module holds the placement model, the rule that sends each
pick of a replicated expert to one replica, the host-side load tracker and
the rebalancer that proposes a placement. The layer takes a placement as
:class:`PlacementArrays` (``moe_layer(..., placement=)``; the device side is
``moe_jax.replicated``); ``moe_jax.rebalance`` moves weights between
placements (see ``docs/design/replication.md``).

Replicas
--------
An expert's replicas are the ranks holding it, one slot per rank: the lowest
slot index on that rank that holds it. A second slot on the same rank holding
the same expert is *inert*: it keeps a copy of the weights but never receives
a row (the rule below only ever picks a rank's first slot of an expert).
Global slot ids are ``rank * S + slot``.

The choice rule
---------------
A pick (token ``t``, expert ``e``) sent from rank ``r`` goes to

* the replica on ``r`` itself when ``r`` holds ``e`` (no transfer), else
* ``replicas(e)[hash32(t) % n_e]``, ``n_e`` the number of replicas and
  ``hash32`` the murmur3 32-bit finalizer of the token id's low 32 bits.

:func:`choose_replica_np` (NumPy) and :func:`choose_replica` (jax.numpy)
compute it from the arrays of :meth:`Placement.as_arrays` only, so the jnp
version can run inside a jitted dispatch plan with the placement as an
array input (a new placement does not recompile). The count-aware
"balanced" rule (:func:`balanced_split_np`, :func:`choose_balanced_np`;
on the device ``moe_jax.replicated.balanced_slot_ids``) levels the step's
own loads over the replicas instead.

The expected-load model
-----------------------
With ``L_e`` rows for expert ``e`` per step and every rank sending the same
share ``L_e / P`` of them (tokens are spread evenly over the ranks), a rank
``q`` holding ``e`` receives its own ``L_e / P`` plus ``1 / n_e`` of the rows
from the ``P - n_e`` non-holders: ``L_e / P * (1 + (P - n_e) / n_e) =
L_e / n_e``. The rule thus splits an expert's load evenly over its replicas,
and a rank's expected rows are ``sum over the experts e it holds of L_e /
n_e`` (:func:`expected_rank_loads`).

The rebalancer
--------------
:func:`propose` keeps every expert on its home slot of the default layout
(expert ``e`` on rank ``e // (E / P)``, slot ``e % (E / P)``), so a rebalance
moves only the spare slots' weights, and fills the ``S - E / P`` spare slots
of each rank:

1. candidates: the ``num_replicated`` experts with the largest load (ties:
   lower id); only they get replicas;
2. three searches, each scored by (busiest rank's expected load, sum of
   squared rank loads): a greedy that adds one replica at a time (the move
   with the best score, from the busiest rank's candidates or from any
   candidate), keeping the best state seen; an enumeration of the
   candidates' replica counts (at most 4096 vectors), each placed largest
   per-replica load first on the least-loaded rank with a free spare slot
   that lacks the expert; and a local search that moves or drops one extra
   replica while the score improves, run on each result;
3. the best result wins; the start (no replication) is among the states the
   greedy scores, so the result is never worse than no replication. On
   random tiny cases it stays within 2% of the brute-force optimum over the
   same search space.

Spare slots a proposal does not use hold an inert copy of the rank's first
home expert. :class:`LoadTracker` keeps the EMA of per-expert loads that
:func:`propose` reads (alpha = 0.99 and 3 replicated experts are the
defaults of the seed field report).
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

__all__ = ["LoadTracker", "Placement", "PlacementArrays", "balanced_split_np",
           "choose_balanced_np", "choose_replica", "choose_replica_np",
           "expected_rank_loads", "hash32_np", "hash32", "propose"]

DEFAULT_ALPHA = 0.99
DEFAULT_NUM_REPLICATED = 3


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_positive_int(name: str, value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    return int(value)


def require_state_keys(state: dict[str, Any], keys: tuple[str, ...]) -> None:
    """ValueError naming the first of `keys` a checkpointed `state` lacks."""
    for key in keys:
        if key not in state:
            raise ValueError(f"state: missing {key!r}")


# --------------------------------------------------------------------------
# Placement
# --------------------------------------------------------------------------


class PlacementArrays(NamedTuple):
    """A placement as the jitted layer takes it (:meth:`Placement.device_arrays`).

    All int32; a pytree of arrays, so a new placement of the same ``P``,
    ``S`` and ``E`` does not recompile. Shapes fix ``P``, ``S`` and ``E``.

    slot_expert: ``[P, S]`` the logical expert each slot holds.
    local_slot: ``[P, E]`` global slot of ``e`` on rank ``p`` (its lowest
      slot there), ``-1`` where ``p`` does not hold ``e``.
    replica_slots: ``[E, P]`` ``e``'s replicas by increasing rank, padded
      with its first replica.
    num_replicas: ``[E]`` ranks holding each expert (>= 1).
    """

    slot_expert: Any
    local_slot: Any
    replica_slots: Any
    num_replicas: Any

    @property
    def num_ranks(self) -> int:
        return int(self.slot_expert.shape[0])

    @property
    def slots_per_rank(self) -> int:
        return int(self.slot_expert.shape[1])

    @property
    def num_slots(self) -> int:
        """``P * S``: the leading dimension of the slot expert weights."""
        return self.num_ranks * self.slots_per_rank

    @property
    def num_experts(self) -> int:
        return int(self.local_slot.shape[1])


class Placement:
    """``E`` logical experts on ``P`` ranks x ``S`` slots per rank.

    Args:
      slot_expert: ``[P, S]`` integers in ``[0, E)``: the logical expert each
        physical slot holds. Every expert must appear on at least one slot.
      num_experts: ``E``.

    Raises ``ValueError`` naming the argument when a check fails. Equality is
    on ``num_experts`` and ``slot_expert``.
    """

    def __init__(self, slot_expert: Any, num_experts: int):
        num_experts = _check_positive_int("num_experts", num_experts)
        arr = np.asarray(slot_expert)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"slot_expert: must contain integers, got dtype {arr.dtype}")
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise ValueError(f"slot_expert: must be [num_ranks, slots_per_rank] with both "
                             f">= 1, got shape {arr.shape}")
        if arr.min() < 0 or arr.max() >= num_experts:
            raise ValueError(f"slot_expert: expert ids must lie in [0, {num_experts}), got "
                             f"[{arr.min()}, {arr.max()}]")
        missing = np.setdiff1d(np.arange(num_experts), arr)
        if missing.size:
            raise ValueError(f"slot_expert: experts {missing.tolist()[:8]} are on no slot "
                             f"(every expert needs >= 1 slot)")
        self._slot_expert = arr.astype(np.int32)
        self._slot_expert.setflags(write=False)
        self._num_experts = num_experts
        self._arrays: dict[str, np.ndarray] | None = None

    # -- shape --------------------------------------------------------------
    @property
    def slot_expert(self) -> np.ndarray:
        """``[P, S]`` int32 (read-only)."""
        return self._slot_expert

    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def num_ranks(self) -> int:
        return int(self._slot_expert.shape[0])

    @property
    def slots_per_rank(self) -> int:
        return int(self._slot_expert.shape[1])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (self.num_experts == other.num_experts
                and np.array_equal(self.slot_expert, other.slot_expert))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Placement(num_experts={self.num_experts}, "
                f"slot_expert={self.slot_expert.tolist()})")

    # -- replicas -----------------------------------------------------------
    def replicas(self, expert: int) -> np.ndarray:
        """Global slot ids (``rank * S + slot``) of ``expert``'s replicas, one per
        rank holding it (that rank's lowest such slot), by increasing rank."""
        if not _is_int(expert) or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert: must be an integer in [0, {self.num_experts}), "
                             f"got {expert!r}")
        a = self.as_arrays()
        return a["replica_slots"][expert, :a["num_replicas"][expert]].copy()

    def replica_ranks(self, expert: int) -> np.ndarray:
        """Ranks holding ``expert``, increasing."""
        return self.replicas(expert) // self.slots_per_rank

    def num_replicas(self) -> np.ndarray:
        """``[E]`` int32: ranks holding each expert."""
        return self.as_arrays()["num_replicas"].copy()

    def as_arrays(self) -> dict[str, np.ndarray]:
        """The placement as int32 NumPy arrays (wrap with ``jnp.asarray`` to pass
        them into a jitted function; nothing else is needed at trace time):

        * ``slot_expert [P, S]``: the expert each slot holds;
        * ``local_slot [P, E]``: the global slot of expert ``e`` on rank ``p``
          (its lowest slot there), ``-1`` where ``p`` does not hold ``e``;
        * ``replica_slots [E, P]``: row ``e`` lists ``e``'s replicas by
          increasing rank, padded with its first replica;
        * ``num_replicas [E]``: ranks holding ``e`` (>= 1).
        """
        if self._arrays is None:
            P, S, E = self.num_ranks, self.slots_per_rank, self.num_experts
            local = np.full((P, E), -1, np.int32)
            # Reverse slot order so the lowest slot of a rank wins.
            for s in range(S - 1, -1, -1):
                local[np.arange(P), self._slot_expert[:, s]] = np.arange(P) * S + s
            holds = local >= 0                                   # [P, E]
            num = holds.sum(axis=0).astype(np.int32)             # [E]
            # Rank order: stable sort of "not held" puts holders first, by rank.
            order = np.argsort(~holds.T, axis=1, kind="stable")  # [E, P]
            reps = np.take_along_axis(local.T, order, axis=1)    # [E, P]
            pad = np.arange(P)[None, :] >= num[:, None]
            reps = np.where(pad, reps[:, :1], reps).astype(np.int32)
            arrays = dict(slot_expert=self._slot_expert, local_slot=local,
                          replica_slots=reps, num_replicas=num)
            for v in arrays.values():
                v.setflags(write=False)
            self._arrays = arrays
        return self._arrays

    def device_arrays(self) -> PlacementArrays:
        """:meth:`as_arrays` as a :class:`PlacementArrays` of ``jnp`` arrays (the
        ``placement`` input of ``moe_jax.moe_layer``)."""
        a = self.as_arrays()
        return PlacementArrays(*(jnp.asarray(a[k]) for k in PlacementArrays._fields))

    def source_slots(self, old: "Placement") -> np.ndarray:
        """``[P * S]`` int32: for each global slot of this placement, a slot of
        ``old`` holding the same expert: the same slot when it already does,
        else the lowest slot of that expert on the same rank, else the
        expert's first replica in ``old`` (the weights then cross ranks)."""
        if (old.num_experts, old.num_ranks, old.slots_per_rank) != (
                self.num_experts, self.num_ranks, self.slots_per_rank):
            raise ValueError(f"old: a placement of E={old.num_experts}, P={old.num_ranks}, "
                             f"S={old.slots_per_rank}; this one has E={self.num_experts}, "
                             f"P={self.num_ranks}, S={self.slots_per_rank}")
        P, S = self.num_ranks, self.slots_per_rank
        a = old.as_arrays()
        new = self.slot_expert
        rank = np.repeat(np.arange(P), S).reshape(P, S)
        same = old.slot_expert == new
        on_rank = a["local_slot"][rank, new]
        first = a["replica_slots"][new, 0]
        here = (rank * S + np.arange(S)[None, :])
        src = np.where(same, here, np.where(on_rank >= 0, on_rank, first))
        return src.reshape(-1).astype(np.int32)

    # -- constructors ---------------------------------------------------------
    @classmethod
    def default(cls, num_experts: int, num_ranks: int, slots_per_rank: int | None = None
                ) -> "Placement":
        """Expert ``e`` on rank ``e // (E / P)``, slot ``e % (E / P)``; no replication.

        Spare slots (``slots_per_rank > E / P``) hold inert copies of the
        rank's first expert: without load information there is nothing to
        replicate, and an inert copy receives no rows, so this placement
        routes exactly like the unreplicated layout. :func:`propose` fills
        the spare slots from measured loads.
        """
        num_experts = _check_positive_int("num_experts", num_experts)
        num_ranks = _check_positive_int("num_ranks", num_ranks)
        if num_experts % num_ranks:
            raise ValueError(f"num_experts: {num_experts} is not a multiple of "
                             f"num_ranks={num_ranks}")
        per_rank = num_experts // num_ranks
        if slots_per_rank is None:
            slots_per_rank = per_rank
        slots_per_rank = _check_positive_int("slots_per_rank", slots_per_rank)
        if slots_per_rank < per_rank:
            raise ValueError(f"slots_per_rank: must be >= num_experts / num_ranks = "
                             f"{per_rank}, got {slots_per_rank}")
        home = np.arange(num_experts, dtype=np.int32).reshape(num_ranks, per_rank)
        spare = np.repeat(home[:, :1], slots_per_rank - per_rank, axis=1)
        return cls(np.concatenate([home, spare], axis=1), num_experts)

    @classmethod
    def spread(cls, num_experts: int, num_ranks: int, slots_per_rank: int) -> "Placement":
        """Every expert on its home slot, and the spare slots filled round-robin
        with the experts of the following ranks: spare slot ``j`` of rank
        ``q`` holds expert ``((q + 1 + j // (E/P)) * (E/P) + j % (E/P)) % E``.
        With ``S = E/P + d`` and ``d`` a multiple of ``E/P``, every expert
        sits on ``1 + d / (E/P)`` consecutive ranks. A static placement for
        the balanced rule (``moe_layer(..., replica_choice="balanced")``),
        which levels the step's own loads over whatever replicas exist."""
        base = cls.default(num_experts, num_ranks, slots_per_rank)
        per_rank = num_experts // num_ranks
        slot_expert = np.array(base.slot_expert)
        for j in range(slots_per_rank - per_rank):
            for q in range(num_ranks):
                slot_expert[q, per_rank + j] = (((q + 1 + j // per_rank) * per_rank
                                                 + j % per_rank) % num_experts)
        return cls(slot_expert, num_experts)

    # -- state ----------------------------------------------------------------
    def to_state(self) -> dict[str, np.ndarray]:
        """Plain dict of arrays (an orbax-checkpointable pytree)."""
        return {"slot_expert": self.slot_expert.copy(),
                "num_experts": np.asarray(self.num_experts, np.int32)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Placement":
        require_state_keys(state, ("slot_expert", "num_experts"))
        return cls(np.asarray(state["slot_expert"]), int(np.asarray(state["num_experts"])))


# --------------------------------------------------------------------------
# The choice rule
# --------------------------------------------------------------------------

_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35
_MASK = 0xFFFFFFFF


def hash32_np(token_idx: Any) -> np.ndarray:
    """murmur3's 32-bit finalizer of the low 32 bits of ``token_idx`` (uint32)."""
    h = np.asarray(token_idx).astype(np.uint64) & np.uint64(_MASK)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(_M1)) & np.uint64(_MASK)
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(_M2)) & np.uint64(_MASK)
    h ^= h >> np.uint64(16)
    return h.astype(np.uint32)


def hash32(token_idx: Any) -> jnp.ndarray:
    """:func:`hash32_np` in jax.numpy (uint32 arithmetic wraps mod 2^32)."""
    h = jnp.asarray(token_idx).astype(jnp.uint32)
    h = h ^ (h >> 16)
    h = h * jnp.uint32(_M1)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(_M2)
    return h ^ (h >> 16)


def choose_replica_np(token_idx: Any, expert: Any, src_rank: Any, local_slot: np.ndarray,
                      replica_slots: np.ndarray, num_replicas: np.ndarray) -> np.ndarray:
    """Global slot (int32, broadcast shape of the inputs) each pick goes to.

    ``token_idx`` (ids in [0, 2^31) agree with :func:`choose_replica`),
    ``expert`` (in [0, E)) and ``src_rank`` (in [0, P)) broadcast together;
    the other arguments are :meth:`Placement.as_arrays`' arrays.
    """
    t, e, r = np.broadcast_arrays(np.asarray(token_idx), np.asarray(expert),
                                  np.asarray(src_rank))
    local = np.asarray(local_slot)[r, e]
    k = hash32_np(t) % np.asarray(num_replicas).astype(np.uint32)[e]
    remote = np.asarray(replica_slots)[e, k.astype(np.int64)]
    return np.where(local >= 0, local, remote).astype(np.int32)


def choose_replica(token_idx: Any, expert: Any, src_rank: Any, local_slot: Any,
                   replica_slots: Any, num_replicas: Any) -> jnp.ndarray:
    """:func:`choose_replica_np` in jax.numpy (jit-safe; arrays only)."""
    e = jnp.asarray(expert, jnp.int32)
    r = jnp.asarray(src_rank, jnp.int32)
    local = jnp.asarray(local_slot)[r, e]
    n = jnp.asarray(num_replicas)[e].astype(jnp.uint32)
    k = (hash32(token_idx) % n).astype(jnp.int32)
    remote = jnp.asarray(replica_slots)[e, k]
    return jnp.where(local >= 0, local, remote).astype(jnp.int32)


# --------------------------------------------------------------------------
# Load tracking and rebalancing
# --------------------------------------------------------------------------


class LoadTracker:
    """EMA of per-expert load (rows per step).

    ``update(counts)``: ``ema = alpha * ema + (1 - alpha) * counts``; the first
    update sets ``ema = counts`` (no bias toward the zero start).

    Args:
      num_experts: ``E``.
      alpha: weight of the past, in [0, 1) (default 0.99, the seed's).
    """

    def __init__(self, num_experts: int, alpha: float = DEFAULT_ALPHA):
        self.num_experts = _check_positive_int("num_experts", num_experts)
        if (isinstance(alpha, (bool, np.bool_)) or not isinstance(alpha, (int, float, np.floating))
                or not 0.0 <= float(alpha) < 1.0):
            raise ValueError(f"alpha: must be a number in [0, 1), got {alpha!r}")
        self.alpha = float(alpha)
        self.ema = np.zeros(num_experts, np.float64)
        self.num_updates = 0

    @property
    def loads(self) -> np.ndarray:
        """``[E]`` float64, the current EMA (a copy)."""
        return self.ema.copy()

    def update(self, counts: Any) -> "LoadTracker":
        """Folds in one step's ``[E]`` per-expert row counts (numbers >= 0)."""
        c = np.asarray(counts, dtype=np.float64)
        if c.shape != (self.num_experts,):
            raise ValueError(f"counts: shape {c.shape}, expected ({self.num_experts},)")
        if not np.isfinite(c).all() or (c < 0).any():
            raise ValueError("counts: must be finite and >= 0")
        if self.num_updates == 0:
            self.ema = c.copy()
        else:
            self.ema = self.alpha * self.ema + (1.0 - self.alpha) * c
        self.num_updates += 1
        return self

    def update_from_experts(self, expert_ids: Any) -> "LoadTracker":
        """One step from the expert ids of its picks (any shape; ids outside
        [0, E), e.g. dropped picks, are ignored)."""
        ids = np.asarray(expert_ids).reshape(-1)
        if ids.size and ids.dtype.kind not in "iu":
            raise ValueError(f"expert_ids: must contain integers, got dtype {ids.dtype}")
        ids = ids[(ids >= 0) & (ids < self.num_experts)].astype(np.int64)
        return self.update(np.bincount(ids, minlength=self.num_experts))

    def update_from_trace(self, trace: Any) -> "LoadTracker":
        """One step from a :class:`~moe_jax.traces.RoutingTrace`."""
        if trace.num_experts != self.num_experts:
            raise ValueError(f"trace: has {trace.num_experts} experts, the tracker "
                             f"{self.num_experts}")
        return self.update_from_experts(trace.experts)

    def to_state(self) -> dict[str, np.ndarray]:
        """Plain dict of arrays (an orbax-checkpointable pytree)."""
        return {"ema": self.ema.astype(np.float32),
                "alpha": np.asarray(self.alpha, np.float32),
                "num_updates": np.asarray(self.num_updates, np.int32)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "LoadTracker":
        require_state_keys(state, ("ema", "alpha", "num_updates"))
        ema = np.asarray(state["ema"], np.float64)
        if ema.ndim != 1:
            raise ValueError(f"state: ema must be 1-D, got shape {ema.shape}")
        out = cls(int(ema.shape[0]), float(np.asarray(state["alpha"])))
        out.ema = ema
        out.num_updates = int(np.asarray(state["num_updates"]))
        return out


def _as_loads(tracker_or_loads: Any) -> np.ndarray:
    if isinstance(tracker_or_loads, LoadTracker):
        return tracker_or_loads.loads
    loads = np.asarray(tracker_or_loads, dtype=np.float64)
    if loads.ndim != 1 or loads.size == 0:
        raise ValueError(f"tracker_or_loads: must be a LoadTracker or [E] loads, got shape "
                         f"{loads.shape}")
    if not np.isfinite(loads).all() or (loads < 0).any():
        raise ValueError("tracker_or_loads: loads must be finite and >= 0")
    return loads


def expected_rank_loads(placement: Placement, loads: Any) -> np.ndarray:
    """``[P]`` expected rows per rank under the choice rule (module docstring):
    each replica of expert ``e`` gets ``loads[e] / n_e``."""
    loads = _as_loads(loads)
    if loads.shape != (placement.num_experts,):
        raise ValueError(f"loads: shape {loads.shape}, expected ({placement.num_experts},)")
    a = placement.as_arrays()
    holds = a["local_slot"] >= 0                                   # [P, E]
    return holds.astype(np.float64) @ (loads / a["num_replicas"])



def _rank_loads(loads: np.ndarray, home: np.ndarray, P: int,
                holders: dict[int, set[int]]) -> np.ndarray:
    """Expected rows per rank: home experts plus the candidates' extra replicas."""
    n = np.ones(loads.size)
    for e, h in holders.items():
        n[e] = len(h)
    rl = np.bincount(home, weights=loads / n, minlength=P).astype(np.float64)
    for e, h in holders.items():
        for q in h:
            if q != home[e]:
                rl[q] += loads[e] / n[e]
    return rl


def _score(rl: np.ndarray) -> tuple[float, float]:
    # Busiest rank first; the sum of squares breaks ties (and rewards
    # lowering the other busy ranks, so a later move can lower the max).
    return (float(rl.max()), float(np.dot(rl, rl)))


def _greedy(loads, candidates, home, P, spare, busiest_only):
    """Adds replicas one at a time (best move by _score) until no slot or move
    is left; returns the best (score, holders) seen, the start included."""
    holders = {e: {int(home[e])} for e in candidates}
    free = np.full(P, spare, np.int64)
    rank_load = _rank_loads(loads, home, P, holders)
    best = (_score(rank_load), {e: set(h) for e, h in holders.items()})
    while True:
        busiest = int(np.argmax(rank_load))
        best_move = None
        for e in candidates:
            h = holders[e]
            if loads[e] == 0 or (busiest_only and busiest not in h):
                continue
            n = len(h)
            rl = rank_load.copy()
            rl[list(h)] += loads[e] / (n + 1) - loads[e] / n
            for q in range(P):
                if q in h or free[q] == 0:
                    continue
                rq = rl.copy()
                rq[q] += loads[e] / (n + 1)
                key = _score(rq) + (e, q)
                if best_move is None or key < best_move[0]:
                    best_move = (key, e, q, rq)
        if best_move is None:
            break
        _, e, q, rank_load = best_move
        holders[e].add(q)
        free[q] -= 1
        s = _score(rank_load)
        if s < best[0]:
            best = (s, {k: set(v) for k, v in holders.items()})
    return best


def _relocate(loads, candidates, home, P, spare, found):
    """Local search from `found`: move one extra replica to another rank with a
    free spare slot, or drop it, while that lowers _score."""
    score, holders = found[0], {e: set(h) for e, h in found[1].items()}
    improved = True
    while improved:
        improved = False
        used = np.zeros(P, np.int64)
        for e, h in holders.items():
            for q in h:
                if q != home[e]:
                    used[q] += 1
        for e in candidates:
            for q in sorted(holders[e] - {int(home[e])}):
                targets = [None] + [r for r in range(P)
                                    if r not in holders[e] and used[r] < spare]
                for r in targets:
                    trial = {k: set(v) for k, v in holders.items()}
                    trial[e].discard(q)
                    if r is not None:
                        trial[e].add(r)
                    s = _score(_rank_loads(loads, home, P, trial))
                    if s < score:
                        score, holders, improved = s, trial, True
                        break
                if improved:
                    break
            if improved:
                break
    return score, holders



_MAX_COUNT_VECTORS = 4096


def _counts_lpt(loads, candidates, home, P, spare):
    """Every vector of replica counts of the candidates (when there are at
    most _MAX_COUNT_VECTORS), each placed largest-per-replica-load first on
    the least-loaded rank that has a free spare slot and lacks the expert;
    returns the best (score, holders), or None when there are too many."""
    limit = min(P, 1 + spare * P)
    if limit ** len(candidates) > _MAX_COUNT_VECTORS:
        return None
    best = None
    for counts in itertools.product(range(1, limit + 1), repeat=len(candidates)):
        if sum(counts) - len(candidates) > spare * P:
            continue
        holders = {e: {int(home[e])} for e in candidates}
        n = dict(zip(candidates, counts))
        share = loads.copy()
        for e in candidates:
            share[e] = loads[e] / n[e]
        rl = np.bincount(home, weights=share, minlength=P).astype(np.float64)
        free = np.full(P, spare, np.int64)
        extras = sorted(((share[e], e) for e in candidates for _ in range(n[e] - 1)),
                        key=lambda x: (-x[0], x[1]))
        ok = True
        for w, e in extras:
            eligible = [q for q in range(P) if free[q] > 0 and q not in holders[e]]
            if not eligible:
                ok = False
                break
            q = min(eligible, key=lambda r: (rl[r], r))
            holders[e].add(q)
            free[q] -= 1
            rl[q] += w
        if not ok:
            continue
        s = _score(rl)
        if best is None or s < best[0]:
            best = (s, holders)
    return best


def propose(tracker_or_loads: Any, num_ranks: int, slots_per_rank: int,
            num_replicated: int = DEFAULT_NUM_REPLICATED) -> Placement:
    """A placement that lowers the busiest rank's expected rows (module docstring).

    Args:
      tracker_or_loads: a :class:`LoadTracker` or ``[E]`` per-expert loads.
      num_ranks: ``P`` (``E % P == 0``).
      slots_per_rank: ``S >= E / P``; the ``S - E / P`` spare slots per rank
        are the budget.
      num_replicated: how many of the hottest experts may get replicas (>= 0).
    Returns:
      a :class:`Placement` whose busiest rank's expected load is <= that of
      :meth:`Placement.default` (no replication).
    """
    loads = _as_loads(tracker_or_loads)
    E = loads.size
    base = Placement.default(E, num_ranks, slots_per_rank)
    if not _is_int(num_replicated) or num_replicated < 0:
        raise ValueError(f"num_replicated: must be an integer >= 0, got {num_replicated!r}")
    P, S = num_ranks, slots_per_rank
    per_rank = E // P
    spare = S - per_rank
    if spare == 0 or num_replicated == 0 or P == 1:
        return base
    candidates = [int(e) for e in np.argsort(-loads, kind="stable")[:num_replicated]]
    home = np.arange(E) // per_rank
    best = None
    for busiest_only in (True, False):
        found = _greedy(loads, candidates, home, P, spare, busiest_only)
        found = _relocate(loads, candidates, home, P, spare, found)
        if best is None or found[0] < best[0]:
            best = found
    found = _counts_lpt(loads, candidates, home, P, spare)
    if found is not None:
        found = _relocate(loads, candidates, home, P, spare, found)
        if found[0] < best[0]:
            best = found
    best_holders = best[1]

    slot_expert = np.array(base.slot_expert)
    next_free = np.full(P, per_rank, np.int64)
    for e in candidates:
        for q in sorted(best_holders[e] - {int(home[e])}):
            slot_expert[q, next_free[q]] = e
            next_free[q] += 1
    return Placement(slot_expert, E)


# --------------------------------------------------------------------------
# The balanced choice rule (count-aware)
# --------------------------------------------------------------------------


def balanced_split_np(counts: Any, replica_slots: np.ndarray, num_replicas: np.ndarray,
                      slots_per_rank: int) -> np.ndarray:
    """``[E, P]`` int64 rows each replica of each expert receives this step
    under the balanced rule (column ``j``: ``replica_slots[e, j]``; zero past
    ``num_replicas[e]``).

    ``counts [P, E]``: the step's rows per (source rank, expert), which every
    rank knows after one all-gather. Experts on one rank load it with all
    their rows; then the replicated experts, by decreasing rows (ties: lower
    id), fill their holders' loads up to a common level: the smallest
    integer ``lam`` with ``sum_j max(0, lam - load_j) >= L_e``; each holder
    gets ``max(0, lam - 1 - load_j)`` rows and the remaining ones go one
    each to the holders at or below ``lam - 1``, lowest replica first.
    """
    counts = np.asarray(counts, np.int64)
    P, E = counts.shape
    reps = np.asarray(replica_slots)
    num = np.asarray(num_replicas)
    total = counts.sum(axis=0)
    holder = reps // slots_per_rank                                   # [E, P]
    valid = np.arange(P)[None, :] < num[:, None]
    load = np.bincount(holder[num == 1, 0], weights=total[num == 1],
                       minlength=P).astype(np.int64)
    sizes = np.zeros((E, P), np.int64)
    sizes[num == 1, 0] = total[num == 1]
    order = sorted(range(E), key=lambda e: (-total[e], e))
    for e in order:
        if num[e] == 1:
            continue
        n, rows = int(num[e]), int(total[e])
        h = holder[e, :n]
        lv = load[h]
        lo, hi = int(lv.min()), int(lv.max()) + rows     # smallest lam in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if np.maximum(mid - lv, 0).sum() >= rows:
                hi = mid
            else:
                lo = mid + 1
        lam = lo
        base = np.maximum(lam - 1 - lv, 0)
        rest = rows - int(base.sum())
        extra = np.zeros(n, np.int64)
        eligible = np.flatnonzero(lv <= lam - 1)
        extra[eligible[:rest]] = 1
        sizes[e, :n] = base + extra
        load[h] += sizes[e, :n]
    sizes[~valid] = 0
    return sizes


def choose_balanced_np(expert: Any, src_rank: Any, counts: Any, replica_slots: np.ndarray,
                       num_replicas: np.ndarray, slots_per_rank: int) -> np.ndarray:
    """Global slot of every pick under the balanced rule.

    ``expert [P, N]``: each source rank's picks in order (ids outside
    ``[0, E)`` are dropped: -1), ``src_rank`` unused beyond the row order
    (row ``r`` is rank ``r``). Expert ``e``'s picks are numbered in (source
    rank, pick) order and cut into consecutive ranges of
    :func:`balanced_split_np`'s sizes, one per replica in replica order.
    """
    del src_rank
    ids = np.asarray(expert, np.int64)
    P, N = ids.shape
    E = np.asarray(num_replicas).shape[0]
    kept = (ids >= 0) & (ids < E)
    onehot = (np.where(kept, ids, E)[..., None] == np.arange(E)).astype(np.int64)  # [P, N, E]
    if counts is None:
        counts = onehot.sum(axis=1)
    counts = np.asarray(counts, np.int64)
    sizes = balanced_split_np(counts, replica_slots, num_replicas, slots_per_rank)
    ends = np.cumsum(sizes, axis=1)                                  # [E, P]
    offset = np.cumsum(counts, axis=0) - counts                      # [P, E]
    safe = np.where(kept, ids, 0)
    seen = np.take_along_axis(np.cumsum(onehot, axis=1) - onehot, safe[..., None], axis=2)[..., 0]
    position = np.take_along_axis(offset, safe, axis=1) + seen      # [P, N]
    replica = (position[..., None] >= ends[safe]).sum(axis=-1)
    replica = np.minimum(replica, np.asarray(num_replicas)[safe] - 1)   # dropped picks
    out = np.asarray(replica_slots)[safe, replica]
    return np.where(kept, out, -1).astype(np.int32)

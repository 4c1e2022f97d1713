"""Replicated experts inside the layer: picks to slots, copies' gradients tied.

With a placement (``moe_jax.replication``), expert weights are stored per
physical slot, ``[P * S, ...]`` split over the expert axis (rank ``p`` holds
global slots ``p * S .. p * S + S - 1``), and every slot holds the weights
of the logical expert ``slot_expert`` names. The dispatch plan then works on
global slot ids exactly as it works on expert ids without replication (a
slot id is a destination rank and a local group: ``experts_per_rank = S``):

* :func:`slot_ids` maps each pick (token, logical expert) to a slot with
  ``moe_jax.replication.choose_replica`` on the device: the replica on the
  sender's own rank when there is one, else one chosen by a fixed hash of
  the token's index in the expert-parallel group (the "local" rule);
* :func:`balanced_slot_ids` (the "balanced" rule) instead cuts each
  expert's picks into per-replica ranges that level the receiving ranks'
  rows, from the step's per-expert counts all-gathered over the expert
  axis (:func:`balanced_sizes`);
* :func:`tie_copies` is the identity on the slot weights whose VJP gives
  every copy of an expert the sum of all its copies' gradients, so copies
  updated by any optimizer from identical states stay identical.

Every pick meets weights equal to its logical expert's, so with the
row-invariant matmul the layer's output is bitwise that of ``dense`` over
the logical weights.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import manual_axes
from moe_jax.experts import ExpertWeights
from moe_jax.ordering import depend_on, opaque_zero
from moe_jax.plan import kept_picks
from moe_jax.replication import Placement, PlacementArrays, choose_replica

__all__ = ["balanced_sizes", "balanced_slot_ids", "check_placement", "dense_slot_ids",
           "logical_weights", "slot_ids", "slot_weights", "tie_copies"]


def check_placement(placement: PlacementArrays, num_experts: int, num_ranks: int | None,
                    num_slots: int, where: str) -> None:
    """Trace-time shape checks of a ``placement`` argument (ValueError naming it)."""
    if not isinstance(placement, PlacementArrays):
        raise ValueError(f"{where}: argument 'placement' must be a PlacementArrays "
                         f"(Placement.device_arrays()), got {type(placement).__name__}")
    P, S = placement.slot_expert.shape
    E = num_experts
    shapes = {"slot_expert": (P, S), "local_slot": (P, E), "replica_slots": (E, P),
              "num_replicas": (E,)}
    for name, shape in shapes.items():
        arr = getattr(placement, name)
        if tuple(arr.shape) != shape or not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{where}: argument 'placement.{name}' must be integer "
                             f"{list(shape)} for E={E} experts on P={P} ranks x S={S} slots, "
                             f"got {arr.dtype}{list(arr.shape)}")
    if num_ranks is not None and P != num_ranks:
        raise ValueError(f"{where}: argument 'placement' is for {P} ranks, the expert axis "
                         f"has {num_ranks}")
    if P * S != num_slots:
        raise ValueError(f"{where}: argument 'params.experts' must hold one expert per slot "
                         f"of the placement ({P} ranks x {S} slots = {P * S}), got {num_slots}")
    if S * P < E:
        raise ValueError(f"{where}: argument 'placement' has {P * S} slots for {E} experts")


def slot_ids(expert_ids: jax.Array, placement: PlacementArrays, rank: jax.Array,
             token_offset: jax.Array) -> jax.Array:
    """[T, k] int32 global slot of each pick, -1 for a dropped pick.

    Args:
      expert_ids: [T, k] integer logical expert ids of this rank's tokens.
      placement: the placement's arrays (replicated on every rank).
      rank: int32 scalar, this rank's index on the expert axis.
      token_offset: int32 scalar added to the local token index to form the
        id that the replica hash reads (e.g. rank * T: the token's index in
        the group).
    Picks that ``moe_jax.plan.kept_picks`` drops (id outside [0, E) or
    repeating an earlier pick of the token) map to -1, so the plan drops
    them as it would without replication. Jit-safe; no gradient.
    """
    ids = expert_ids.astype(jnp.int32)
    num_experts = placement.num_experts
    kept = kept_picks(ids, num_experts)
    safe = jnp.where(kept, ids, 0)
    token = (token_offset + jnp.arange(ids.shape[0], dtype=jnp.int32))[:, None]
    slots = choose_replica(token, safe, rank, placement.local_slot, placement.replica_slots,
                           placement.num_replicas)
    return jnp.where(kept, slots, -1).astype(jnp.int32)


def balanced_sizes(counts: jax.Array, placement: PlacementArrays) -> jax.Array:
    """``[E, P]`` int32 rows each replica of each expert receives under the
    balanced rule (``moe_jax.replication.balanced_split_np``, the same
    integers): single-rank experts load their rank, then the replicated
    ones, by decreasing rows, level their holders' loads.

    counts: ``[P, E]`` int32 rows per (source rank, expert) of the step, the
    same on every rank (one all-gather). Jit-safe; no gradient.
    """
    counts = counts.astype(jnp.int32)
    P, E = counts.shape
    S = placement.slots_per_rank
    total = jnp.sum(counts, axis=0)
    num = placement.num_replicas.astype(jnp.int32)
    holder = placement.replica_slots.astype(jnp.int32) // S                # [E, P]
    valid = jnp.arange(P)[None, :] < num[:, None]
    single = num == 1
    load = jnp.zeros((P,), jnp.int32).at[holder[:, 0]].add(jnp.where(single, total, 0))
    sizes = jnp.zeros((E, P), jnp.int32).at[:, 0].set(jnp.where(single, total, 0))
    big = jnp.iinfo(jnp.int32).max // 2
    # Only replicated experts move the levels; each takes at least one extra
    # slot, so at most P * S - E of them, visited by decreasing rows (ties:
    # lower id) as the reference visits them.
    steps = max(1, min(E, placement.num_slots - E))
    order = jnp.argsort(jnp.where(single, big, -total), stable=True)[:steps]
    index = jnp.arange(P, dtype=jnp.int32)

    def step(i, carry):
        load, sizes = carry
        e = order[i]
        rows, h, v = total[e], holder[e], valid[e]
        lv = load[h]
        # Smallest integer lam with sum_j max(lam - lv_j, 0) >= rows: the fill
        # of the holders at or below holder j (by load, then index) reaches
        # rows at ceil((rows + their load) / their number); lam is the least
        # of these. Pairwise over the P holders: no sort on the device.
        below = v[None, :] & ((lv[None, :] < lv[:, None]) |
                              ((lv[None, :] == lv[:, None]) & (index[None, :] <= index[:, None])))
        num_below = jnp.sum(below, axis=1, dtype=jnp.int32)
        load_below = jnp.sum(jnp.where(below, lv[None, :], 0), axis=1)
        level = (rows + load_below + num_below - 1) // jnp.maximum(num_below, 1)
        lam = jnp.min(jnp.where(v, level, big))
        base = jnp.where(v, jnp.maximum(lam - 1 - lv, 0), 0)
        rest = rows - jnp.sum(base)
        eligible = v & (lv <= lam - 1)
        extra = eligible & (jnp.cumsum(eligible.astype(jnp.int32)) - 1 < rest)
        share = jnp.where(single[e], 0, base + extra.astype(jnp.int32))
        load = load.at[h].add(share)
        sizes = jnp.where(single[e], sizes, sizes.at[e].set(share))
        return load, sizes

    # Unrolled: a device-side loop pays a host round trip per iteration.
    _, sizes = jax.lax.fori_loop(0, steps, step, (load, sizes),
                                 unroll=True if steps <= 32 else 8)
    return sizes


def balanced_slot_ids(expert_ids: jax.Array, placement: PlacementArrays, rank: jax.Array,
                      all_gather: Callable) -> jax.Array:
    """[T, k] int32 global slot of each pick under the balanced rule, -1 for
    a dropped pick.

    The rank's per-expert counts are all-gathered (``all_gather``: [E] ->
    [P, E] over the expert axis); expert ``e``'s picks, numbered in (source
    rank, token, pick) order, are cut into consecutive ranges of
    :func:`balanced_sizes` rows, one per replica in replica order. Every
    rank computes the same sizes, so the receivers' loads are levelled by
    the step's own counts (no preference for the sender's own replica).
    Jit-safe; no gradient.
    """
    ids = expert_ids.astype(jnp.int32)
    E = placement.num_experts
    kept = kept_picks(ids, E)
    flat = jnp.where(kept, ids, E).reshape(-1)                           # E: dropped
    onehot = (flat[:, None] == jnp.arange(E)[None, :]).astype(jnp.int32)  # [N, E]
    counts = all_gather(jnp.sum(onehot, axis=0))                          # [P, E]
    seen = jnp.cumsum(onehot, axis=0) - onehot
    safe = jnp.minimum(flat, E - 1)
    before = jnp.take_along_axis(seen, safe[:, None], axis=1)[:, 0]
    offset = (jnp.cumsum(counts, axis=0) - counts)[rank]                 # [E]
    position = offset[safe] + before
    ends = jnp.cumsum(balanced_sizes(counts, placement), axis=1)          # [E, P]
    replica = jnp.sum(position[:, None] >= ends[safe], axis=1)
    replica = jnp.minimum(replica, placement.num_replicas.astype(jnp.int32)[safe] - 1)
    slots = placement.replica_slots.astype(jnp.int32)[safe, replica]
    return jnp.where(flat < E, slots, -1).reshape(ids.shape).astype(jnp.int32)


def dense_slot_ids(expert_ids: jax.Array, placement: PlacementArrays) -> jax.Array:
    """[T, k] int32: every pick to its expert's first replica (one rank holding
    all slots, as strategy "dense" runs); -1 for a dropped pick."""
    ids = expert_ids.astype(jnp.int32)
    kept = kept_picks(ids, placement.num_experts)
    first = placement.replica_slots[jnp.where(kept, ids, 0), 0]
    return jnp.where(kept, first, -1).astype(jnp.int32)


def _tie_bwd(g, local_experts, slot_expert, num_experts, psum):
    """Each local slot's gradient becomes the sum over every copy of its
    expert (all ranks), float32 accumulation, same bits on every copy."""
    num_slots = slot_expert.size
    extra = num_slots - num_experts    # experts on >= 2 slots: at most this many
    if extra <= 0:
        return g
    flat = slot_expert.reshape(-1)
    copies = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    multi = copies > 1
    index = jnp.where(multi, jnp.cumsum(multi.astype(jnp.int32)) - 1, extra)   # [E]
    mine = index[local_experts]                                               # [S_local]
    buf = jnp.zeros((extra,) + g.shape[1:], jnp.float32)
    buf = buf.at[mine].add(g.astype(jnp.float32), mode="drop")
    buf = psum(buf)
    tied = buf[jnp.minimum(mine, extra - 1)].astype(g.dtype)
    keep = (mine < extra).reshape((-1,) + (1,) * (g.ndim - 1))
    return jnp.where(keep, tied, g)


def tie_copies(weights: ExpertWeights, tokens: jax.Array, placement: PlacementArrays,
               local_experts: jax.Array, psum: Callable | None = None
               ) -> tuple[ExpertWeights, jax.Array]:
    """The identity on (slot weights, tokens); its VJP sums the gradients of
    all copies of an expert and gives every copy that sum.

    Args:
      weights: this rank's slot weights ``[S_local, ...]`` (all ``P * S``
        slots when one rank holds them, as with "dense").
      tokens: ``[T, H]`` the layer's input on this rank (untouched; its
        gradient orders the all-reduce, below).
      placement: the placement's arrays.
      local_experts: ``[S_local]`` int32 logical expert of each local slot.
      psum: sums over the expert axis (inside ``shard_map``); None when
        ``weights`` holds every slot.
    Only experts on two or more slots are summed across ranks: one
    ``[P * S - E, ...]`` float32 all-reduce per weight in the backward. It
    runs after the tokens' gradient is complete (every collective of the
    layer's backward) and the tokens' gradient leaves after it, so the
    backward's collectives keep one order on every rank. Differentiable
    (that is its point); graph-capturable.
    """
    reduce = psum if psum is not None else (lambda t: t)
    num_experts = placement.num_experts

    @jax.custom_vjp
    def tie(w, x, local_experts, slot_expert):
        return w, x

    def fwd(w, x, local_experts, slot_expert):
        return (w, x), (local_experts, slot_expert)

    def bwd(res, cotangents):
        local_experts, slot_expert = res
        g_w, g_x = cotangents
        if psum is not None:
            g_w = depend_on(g_w, opaque_zero(g_x))
        g_w = jax.tree.map(
            lambda g: _tie_bwd(g, local_experts, slot_expert, num_experts, reduce), g_w)
        if psum is not None:
            g_x = depend_on(g_x, opaque_zero(jax.tree.leaves(g_w)[0]))
        float0 = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
        return g_w, g_x, float0(local_experts), float0(slot_expert)

    tie.defvjp(fwd, bwd)
    # Weights typed as varying like the tokens (data axes too): the cast's
    # transpose, the sum over data-parallel groups, stays outside the tie.
    axes = manual_axes.varying_axes(tokens, *jax.tree.leaves(weights))
    weights = jax.tree.map(lambda w: manual_axes.as_varying(w, axes), weights)
    tokens = manual_axes.as_varying(tokens, axes)
    return tie(weights, tokens, local_experts.astype(jnp.int32),
               placement.slot_expert.astype(jnp.int32))


def slot_weights(logical: ExpertWeights, placement: Placement | PlacementArrays
                 ) -> ExpertWeights:
    """``[P * S, ...]`` slot weights from ``[E, ...]`` logical ones (slot ``g``
    holds its expert's weights). Jit-safe; unsharded unless jitted with
    ``out_shardings``."""
    se = placement.slot_expert
    index = jnp.asarray(np.asarray(se) if isinstance(placement, Placement) else se).reshape(-1)
    return jax.tree.map(lambda w: jnp.take(w, index, axis=0), logical)


def logical_weights(slots: ExpertWeights, placement: Placement | PlacementArrays
                    ) -> ExpertWeights:
    """``[E, ...]`` logical weights read from each expert's first replica."""
    reps = placement.replica_slots if isinstance(placement, PlacementArrays) \
        else placement.as_arrays()["replica_slots"]
    index = jnp.asarray(reps)[:, 0]
    return jax.tree.map(lambda w: jnp.take(w, index, axis=0), slots)

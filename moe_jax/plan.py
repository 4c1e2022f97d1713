"""The dispatch plan: where every (token, k-slot) goes, in a fixed order.

Slot n = t * k + j is (token t, pick j). Global expert e lives on rank
e // experts_per_rank as local expert e % experts_per_rank. Slots are
ordered by (destination rank, local expert, token, pick), which is the
stable sort of their expert ids; for destination p this ordered list is the
(this rank -> p) stream. Every strategy moves the same streams in the same
order, so every strategy delivers the same rows to each expert, in the same
order: by (source rank, token, pick).

Picks that break the plan's preconditions are dropped, the same way on
every strategy: an expert id outside [0, E), or one that repeats an earlier
pick of the same token, gets no stream position (it moves nowhere and adds
nothing to its token's output, nor any gradient), and DispatchStats counts
it in `dropped_rows`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class DispatchPlan(NamedTuple):
    """Per-rank dispatch plan for T tokens, k picks, P ranks (all int32).

    expert_ids: [T, k] global expert of each slot, -1 for a dropped pick.
    dest: [N] destination rank of each slot, N = T * k (0 for a dropped pick).
    pos: [N] position of each slot in its (this rank -> dest) stream
      (DROPPED_POS for a dropped pick: past every window).
    sorted_slots: [N] slots in stream order (destination-major), dropped
      slots last (after every stream).
    send_counts: [P] stream length to each destination.
    send_offsets: [P] start of each destination's stream in sorted_slots.
    send_expert_counts: [P, E_local] rows for each (destination, local expert).
    """

    expert_ids: jax.Array
    dest: jax.Array
    pos: jax.Array
    sorted_slots: jax.Array
    send_counts: jax.Array
    send_offsets: jax.Array
    send_expert_counts: jax.Array

    @property
    def top_k(self) -> int:
        return self.expert_ids.shape[1]

    @property
    def num_slots(self) -> int:
        """N = T * k, dropped slots included."""
        return self.sorted_slots.shape[0]

    @property
    def num_ranks(self) -> int:
        return self.send_counts.shape[0]

    @property
    def experts_per_rank(self) -> int:
        return self.send_expert_counts.shape[1]


DROPPED_POS = jnp.iinfo(jnp.int32).max
"""Stream position of a dropped pick: outside every window of every pass."""


def kept_picks(expert_ids: jax.Array, num_experts: int) -> jax.Array:
    """[T, k] bool: picks with an id in [0, num_experts) that no earlier
    pick of the same token repeats (the others are dropped)."""
    ids = expert_ids.astype(jnp.int32)
    top_k = ids.shape[-1]
    earlier = jnp.tril(jnp.ones((top_k, top_k), bool), -1)          # [j, j'] j' < j
    repeats = jnp.any((ids[..., :, None] == ids[..., None, :]) & earlier, axis=-1)
    return (ids >= 0) & (ids < num_experts) & ~repeats


def drop_invalid_picks(expert_ids: jax.Array, num_experts: int) -> jax.Array:
    """expert_ids as int32 with every dropped pick (see kept_picks) set to -1."""
    ids = expert_ids.astype(jnp.int32)
    return jnp.where(kept_picks(ids, num_experts), ids, -1)


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def make_plan(expert_ids: jax.Array, num_ranks: int, experts_per_rank: int) -> DispatchPlan:
    """Builds the plan from routing decisions.

    Args:
      expert_ids: [T, k] integer global expert ids, distinct per token, in
        [0, num_ranks * experts_per_rank); picks that are not are dropped
        (module doc).
      num_ranks: P, ranks in the expert-parallel group (1 for no parallelism).
      experts_per_rank: E_local.
    """
    num_experts = num_ranks * experts_per_rank
    ids = drop_invalid_picks(expert_ids, num_experts)
    flat = ids.reshape(-1)
    kept = flat >= 0
    key = jnp.where(kept, flat, num_experts)         # dropped slots sort last
    num_slots = flat.shape[0]
    sorted_slots = jnp.argsort(key, stable=True).astype(jnp.int32)
    rank_in_order = jnp.zeros((num_slots,), jnp.int32).at[sorted_slots].set(
        jnp.arange(num_slots, dtype=jnp.int32))
    expert_counts = jnp.zeros((num_experts,), jnp.int32).at[key].add(1, mode="drop")
    send_expert_counts = expert_counts.reshape(num_ranks, experts_per_rank)
    send_counts = jnp.sum(send_expert_counts, axis=1)
    send_offsets = exclusive_cumsum(send_counts)
    dest = jnp.where(kept, flat // experts_per_rank, 0)
    pos = jnp.where(kept, rank_in_order - send_offsets[dest], DROPPED_POS)
    return DispatchPlan(ids, dest, pos, sorted_slots, send_counts, send_offsets,
                        send_expert_counts)


def worst_case_rows_per_peer(tokens: int, top_k: int, experts_per_rank: int) -> int:
    """The most rows one source can send one destination: each token sends a
    destination at most min(k, E_local) copies (its kept picks are distinct)."""
    return tokens * min(top_k, experts_per_rank)

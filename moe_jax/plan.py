"""The dispatch plan: where every (token, k-slot) goes, in a fixed order.

Slot n = t * k + j is (token t, pick j). Global expert e lives on rank
e // experts_per_rank as local expert e % experts_per_rank. Slots are
ordered by (destination rank, local expert, token, pick), which is the
stable sort of their expert ids; for destination p this ordered list is the
(this rank -> p) stream. Every strategy moves the same streams in the same
order, so every strategy delivers the same rows to each expert, in the same
order: by (source rank, token, pick).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class DispatchPlan(NamedTuple):
    """Per-rank dispatch plan for T tokens, k picks, P ranks (all int32).

    expert_ids: [T, k] global expert of each slot.
    dest: [N] destination rank of each slot, N = T * k.
    pos: [N] position of each slot in its (this rank -> dest) stream.
    sorted_slots: [N] slots in stream order (destination-major).
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
    def num_ranks(self) -> int:
        return self.send_counts.shape[0]

    @property
    def experts_per_rank(self) -> int:
        return self.send_expert_counts.shape[1]


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def make_plan(expert_ids: jax.Array, num_ranks: int, experts_per_rank: int) -> DispatchPlan:
    """Builds the plan from routing decisions.

    Args:
      expert_ids: [T, k] int32 global expert ids in [0, num_ranks * experts_per_rank).
      num_ranks: P, ranks in the expert-parallel group (1 for no parallelism).
      experts_per_rank: E_local.
    """
    num_experts = num_ranks * experts_per_rank
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    num_slots = flat.shape[0]
    sorted_slots = jnp.argsort(flat, stable=True).astype(jnp.int32)
    rank_in_order = jnp.zeros((num_slots,), jnp.int32).at[sorted_slots].set(
        jnp.arange(num_slots, dtype=jnp.int32))
    expert_counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    send_expert_counts = expert_counts.reshape(num_ranks, experts_per_rank)
    send_counts = jnp.sum(send_expert_counts, axis=1)
    send_offsets = exclusive_cumsum(send_counts)
    dest = flat // experts_per_rank
    pos = rank_in_order - send_offsets[dest]
    return DispatchPlan(expert_ids.astype(jnp.int32), dest, pos, sorted_slots,
                        send_counts, send_offsets, send_expert_counts)


def worst_case_rows_per_peer(tokens: int, top_k: int, experts_per_rank: int) -> int:
    """The most rows one source can send one destination: each token sends a
    destination at most min(k, E_local) copies (its k experts are distinct)."""
    return tokens * min(top_k, experts_per_rank)

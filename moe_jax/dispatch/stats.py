"""Counters a dispatch reports: how much spilled, whether the fallback ran."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class DispatchStats(NamedTuple):
    """Per-call dispatch counters, int32 scalars equal on every rank.

    From dispatch_combine: its group's. From moe_layer with
    MoEConfig.data_axes: every data group's together (see over_groups).

    rows: (token, pick) rows routed, all ranks together.
    max_peer_rows: the largest (source -> destination) stream.
    spilled_rows: rows moved by the spill pass (cap_and_spill).
    overflow_rows: rows beyond capacity + spill_capacity, moved by the fallback.
    spill_steps: 1 if this call spilled any row, else 0.
    fallback_steps: 1 if this call ran the fallback, else 0.
    dropped_rows: (token, pick) rows dropped because their expert id was
      outside [0, E) or repeated an earlier pick of the same token (they
      move nowhere and add nothing to the output; see moe_jax/plan.py);
      always 0 for the layer's own routing.
    """

    rows: jax.Array
    max_peer_rows: jax.Array
    spilled_rows: jax.Array
    overflow_rows: jax.Array
    spill_steps: jax.Array
    fallback_steps: jax.Array
    dropped_rows: jax.Array

    def over_groups(self, psum, pmax) -> "DispatchStats":
        """One call's counters for several independent rank groups (data
        parallelism) from each group's: row counts summed, the largest
        stream and the step flags maxed. psum / pmax reduce over the groups."""
        rows, spilled, overflow, dropped = psum((self.rows, self.spilled_rows,
                                                 self.overflow_rows, self.dropped_rows))
        max_peer, spill, fallback = pmax((self.max_peer_rows, self.spill_steps,
                                          self.fallback_steps))
        return DispatchStats(rows, max_peer, spilled, overflow, spill, fallback, dropped)

    @staticmethod
    def zeros() -> "DispatchStats":
        return DispatchStats(*(jnp.zeros((), jnp.int32) for _ in DispatchStats._fields))

    def __add__(self, other: "DispatchStats") -> "DispatchStats":  # accumulate over calls
        return DispatchStats(self.rows + other.rows,
                             jnp.maximum(self.max_peer_rows, other.max_peer_rows),
                             self.spilled_rows + other.spilled_rows,
                             self.overflow_rows + other.overflow_rows,
                             self.spill_steps + other.spill_steps,
                             self.fallback_steps + other.fallback_steps,
                             self.dropped_rows + other.dropped_rows)


def stream_stats(peer_counts: jax.Array, capacity: int | None = None,
                 spill_capacity: int = 0, *, num_slots: int) -> DispatchStats:
    """Stats of one call from the [P, P] (source, destination) row counts,
    which every rank holds (so the stats need no further collective and are
    equal on every rank). capacity None: no cap. num_slots: the (token, pick)
    slots of the whole group, P * T * k (static: every rank has T tokens);
    those missing from the counts were dropped."""
    counts = peer_counts.astype(jnp.int32)
    rows = jnp.sum(counts)
    max_peer = jnp.max(counts)
    dropped = jnp.int32(num_slots) - rows
    if capacity is None:
        zero = jnp.zeros((), jnp.int32)
        return DispatchStats(rows, max_peer, zero, zero, zero, zero, dropped)
    spilled = jnp.sum(jnp.clip(counts - capacity, 0, spill_capacity))
    overflow = jnp.sum(jnp.maximum(counts - capacity - spill_capacity, 0))
    return DispatchStats(rows, max_peer, spilled, overflow, (spilled > 0).astype(jnp.int32),
                         (overflow > 0).astype(jnp.int32), dropped)

"""Host-side rebalancing between steps: track load, propose, move weights.

A :class:`Rebalancer` holds one MoE layer's placement and the EMA of its
per-expert load. Each step feeds it the layer's ``aux.expert_rows``; when
asked, it proposes a placement (``moe_jax.replication.propose``: the
busiest rank's expected rows minimized under the slot budget) and moves
the slot weights, and any optimizer state of the same ``[P * S, ...]``
layout, to it with :func:`move_slots`::

    reb = Rebalancer(num_experts=8, num_ranks=4, slots_per_rank=3)
    params = slot_weights(logical, reb.placement)          # [P * S, ...]
    ...
    y, aux = step(params, x, reb.placement.device_arrays())
    reb.observe(aux.expert_rows)
    if step % 100 == 0:
        (params, mu, nu), moved = reb.rebalance((params, mu, nu), mesh)

Its state (placement and EMA) is a dict of arrays that orbax checkpoints
with the rest of a training state (:meth:`Rebalancer.to_state`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_jax.replication import (DEFAULT_ALPHA, DEFAULT_NUM_REPLICATED, LoadTracker, Placement,
                                 propose, require_state_keys)

__all__ = ["Rebalancer", "move_slots"]


def move_slots(tree: Any, source: Any, mesh: jax.sharding.Mesh | None = None,
               axis: str = "ep") -> Any:
    """Every leaf ``[P * S, ...]`` gathered as ``leaf[source]``.

    Args:
      tree: a pytree of slot-major arrays (expert weights, optimizer moments).
      source: ``[P * S]`` int32, e.g. ``Placement.source_slots``.
      mesh: when given, leaves are laid out split over ``axis`` before and
        after; the gather then runs as one jitted program whose cross-rank
        copies are XLA's collectives (slots that keep their expert copy
        locally).
    Returns the moved tree (new arrays). Runs between steps, not under the
    layer's jit; exact (a copy).
    """
    source = np.asarray(source, np.int32)
    leaves = jax.tree.leaves(tree)
    for leaf in leaves:
        if leaf.ndim < 1 or leaf.shape[0] != source.shape[0]:
            raise ValueError(f"tree: every leaf must be [P * S = {source.shape[0]}, ...], got "
                             f"shape {list(leaf.shape)}")
    index = jnp.asarray(source)
    if mesh is None:
        return jax.jit(lambda t: jax.tree.map(lambda a: jnp.take(a, index, axis=0), t))(tree)
    split = NamedSharding(mesh, P(axis))
    tree = jax.tree.map(lambda a: jax.device_put(a, split), tree)
    move = jax.jit(lambda t: jax.tree.map(lambda a: jnp.take(a, index, axis=0), t),
                   out_shardings=jax.tree.map(lambda _: split, tree))
    return move(tree)


class Rebalancer:
    """One layer's placement and load EMA.

    Args:
      num_experts, num_ranks, slots_per_rank: ``E``, ``P``, ``S``
        (``S >= E / P``).
      alpha: EMA weight of the past (default 0.99).
      num_replicated: how many of the hottest experts get replicas
        (default 3).
      placement: the starting placement (default ``Placement.default``:
        no replication, spare slots inert).
    """

    def __init__(self, num_experts: int, num_ranks: int, slots_per_rank: int, *,
                 alpha: float = DEFAULT_ALPHA, num_replicated: int = DEFAULT_NUM_REPLICATED,
                 placement: Placement | None = None):
        self.placement = placement if placement is not None else Placement.default(
            num_experts, num_ranks, slots_per_rank)
        if (self.placement.num_experts, self.placement.num_ranks,
                self.placement.slots_per_rank) != (num_experts, num_ranks, slots_per_rank):
            raise ValueError(f"placement: is for E={self.placement.num_experts}, "
                             f"P={self.placement.num_ranks}, S={self.placement.slots_per_rank}, "
                             f"not E={num_experts}, P={num_ranks}, S={slots_per_rank}")
        if not isinstance(num_replicated, (int, np.integer)) or num_replicated < 0:
            raise ValueError(f"num_replicated: must be an integer >= 0, got {num_replicated!r}")
        self.tracker = LoadTracker(num_experts, alpha)
        self.num_replicated = int(num_replicated)

    def observe(self, expert_rows: Any) -> "Rebalancer":
        """Folds one step's ``[E]`` rows per logical expert (``aux.expert_rows``)
        into the EMA (reads the array to the host)."""
        self.tracker.update(np.asarray(jax.device_get(expert_rows), np.float64))
        return self

    def propose(self) -> Placement:
        """The placement :func:`moe_jax.replication.propose` makes of the EMA."""
        p = self.placement
        return propose(self.tracker, p.num_ranks, p.slots_per_rank, self.num_replicated)

    def rebalance(self, tree: Any, mesh: jax.sharding.Mesh | None = None, axis: str = "ep",
                  placement: Placement | None = None) -> tuple[Any, bool]:
        """Moves to ``placement`` (default: :meth:`propose`) and returns
        (``tree`` moved with :func:`move_slots`, whether the placement changed).
        ``tree``: slot weights and anything else of their ``[P * S, ...]``
        layout (optimizer moments)."""
        new = self.propose() if placement is None else placement
        if new == self.placement:
            return tree, False
        moved = move_slots(tree, new.source_slots(self.placement), mesh, axis)
        self.placement = new
        return moved, True

    def to_state(self) -> dict[str, Any]:
        """Placement and EMA as a dict of arrays (orbax-checkpointable)."""
        return {"placement": self.placement.to_state(), "load": self.tracker.to_state(),
                "num_replicated": np.asarray(self.num_replicated, np.int32)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Rebalancer":
        require_state_keys(state, ("placement", "load", "num_replicated"))
        placement = Placement.from_state(state["placement"])
        tracker = LoadTracker.from_state(state["load"])
        out = cls(placement.num_experts, placement.num_ranks, placement.slots_per_rank,
                  alpha=tracker.alpha, num_replicated=int(np.asarray(state["num_replicated"])),
                  placement=placement)
        out.tracker = tracker
        return out

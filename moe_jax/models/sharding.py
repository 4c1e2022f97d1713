"""Where the decoder's parameters live on an expert-parallel mesh."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_jax.models.decoder import EXPERT_PARAM_NAMES


def _key_name(entry) -> str | None:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return None


def is_expert_path(path) -> bool:
    """True for the stacked expert weights (w_gate, w_up, w_down)."""
    return any(_key_name(e) in EXPERT_PARAM_NAMES for e in path)


def expert_parallel(mesh: jax.sharding.Mesh | None, axis: str, num_experts: int) -> bool:
    return (mesh is not None and axis in mesh.axis_names
            and num_experts % mesh.shape[axis] == 0)


def param_shardings(tree: Any, mesh: jax.sharding.Mesh, axis: str = "ep") -> Any:
    """NamedShardings for a params tree (canonical dict or nnx State, arrays
    or ShapeDtypeStructs): expert weights split over `axis` along their
    first (expert) dimension, everything else replicated (expert weights too
    when the axis is missing or their count does not divide by its size)."""
    size = mesh.shape[axis] if axis in mesh.axis_names else 0

    def spec(path, leaf):
        split = is_expert_path(path) and size and leaf.shape[0] % size == 0
        return NamedSharding(mesh, P(axis) if split else P())

    return jax.tree_util.tree_map_with_path(spec, tree)


def shard_params(tree: Any, mesh: jax.sharding.Mesh | None, axis: str = "ep") -> Any:
    """Places a params tree as `param_shardings` says (no-op without a mesh)."""
    if mesh is None:
        return tree
    return jax.device_put(tree, param_shardings(tree, mesh, axis))

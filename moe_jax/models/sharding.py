"""Where the decoder's parameters and inputs live on an expert-parallel mesh.

Under ``jax.distributed`` (several processes, one mesh over all their
devices) a mesh is not fully addressable: each process holds only its own
devices' shards. :func:`place` then builds global arrays shard by shard from
host values every process holds (``jax.make_array_from_callback``); with one
process it is a plain ``jax.device_put``. :func:`to_host` is the inverse
(``process_allgather`` across processes).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_jax.models.decoder import EXPERT_PARAM_NAMES, LEGACY_EXPERT_PARAM_NAMES


def _key_name(entry) -> str | None:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return None


def is_expert_path(path) -> bool:
    """True for the stacked expert weights (w_gate_up, w_down; w_gate and
    w_up in checkpoints written before they were fused)."""
    names = EXPERT_PARAM_NAMES + LEGACY_EXPERT_PARAM_NAMES
    return any(_key_name(e) in names for e in path)


def expert_parallel(mesh: jax.sharding.Mesh | None, axis: str, num_experts: int) -> bool:
    return (mesh is not None and axis in mesh.axis_names
            and num_experts % mesh.shape[axis] == 0)


def spans_processes(mesh: jax.sharding.Mesh | None) -> bool:
    """True when `mesh` holds devices of more than one process."""
    if mesh is None:
        return False
    return len({d.process_index for d in mesh.devices.flat}) > 1


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


def _global_array(leaf: Any, sharding: NamedSharding) -> jax.Array:
    """`leaf` (a host value every process holds, or a global array) laid out
    as `sharding`, whose devices may belong to several processes."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return jax.device_put(leaf, sharding)  # already global: reshard
    host = np.asarray(leaf)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place(tree: Any, shardings: Any) -> Any:
    """Places every leaf of `tree` as the matching NamedSharding says.

    With one process this is ``jax.device_put``. When the shardings span
    several processes every process must call it with the same values (the
    same seed, the same prompts): each one builds its own devices' shards.
    """
    leaves = jax.tree.leaves(shardings)
    if not leaves or not any(spans_processes(s.mesh) for s in leaves):
        return jax.device_put(tree, shardings)
    return jax.tree.map(_global_array, tree, shardings)


def shard_params(tree: Any, mesh: jax.sharding.Mesh | None, axis: str = "ep") -> Any:
    """Places a params tree as `param_shardings` says (no-op without a mesh)."""
    if mesh is None:
        return tree
    return place(tree, param_shardings(tree, mesh, axis))


def replicate(tree: Any, mesh: jax.sharding.Mesh | None) -> Any:
    """Every leaf of `tree` replicated on `mesh` (no-op without a mesh)."""
    if mesh is None:
        return tree
    return place(tree, jax.tree.map(lambda _: NamedSharding(mesh, P()), tree))


def to_host(x: Any) -> np.ndarray:
    """The whole value of an array as numpy, also when it spans processes
    (then every process must call this, in the same order)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)

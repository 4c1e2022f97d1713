"""All-to-alls: the ragged one among the CPU devices of one execution
(`moe_jax_all_to_all`) and the dense one over XLA's NCCL communicator on
GPUs (`moe_jax_nccl_all_to_all`).

Semantics: docs/design/custom_calls.md; the pure-JAX reference of the
ragged one: moe_jax/refs.py. Differentiable: an all-to-all's transpose is
the reverse all-to-all with the same counts.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import refs
from moe_jax.ops.ffi import (call_ffi, check, check_index, replica_groups, require_handlers,
                             same_varying)

ALL_TO_ALL = "moe_jax_all_to_all"
NCCL_ALL_TO_ALL = "moe_jax_nccl_all_to_all"


_channel_ids = itertools.count(1)


def _group_index(axis_name: str) -> jax.Array:
    """int32 index of this device's group along `axis_name`: the same for
    every rank of one group, distinct across groups (the other mesh axes'
    indices, row-major). The in-process rendezvous keys meetings by it."""
    mesh = jax.sharding.get_abstract_mesh()
    others = [n for n in getattr(mesh, "axis_names", ()) if n != axis_name and mesh.shape[n] > 1]
    auto = [n for n in others if n not in getattr(mesh, "manual_axes", ())]
    check(not auto, ALL_TO_ALL, "axis_name",
           f"the CPU all-to-all custom call runs one group per combination of the other mesh "
           f"axes, which must be manual in the enclosing shard_map; {auto} are not (call "
           f"shard_map over the whole mesh, or use transport='lax' or the reference)")
    group = jnp.zeros((), jnp.int32)
    for name in others:
        group = group * mesh.shape[name] + jax.lax.axis_index(name).astype(jnp.int32)
    return group


def ragged_all_to_all(send, send_offsets, send_sizes, recv_offsets, *, recv_rows: int,
                      axis_name: str, impl: str = "custom_call"):
    """All-to-all of ragged row ranges among the ranks of `axis_name`.

    Call inside `jax.shard_map`. Rank r sends rows
    send[send_offsets[p] : send_offsets[p] + send_sizes[p]] to each rank p;
    they land at recv[recv_offsets[r] ...] on p, where recv_offsets are the
    receiver's own. Rows nobody wrote are zero.

    Args:
      send: [Ns, ...] any dtype.
      send_offsets, send_sizes, recv_offsets: [P] int32.
      recv_rows: static row count of the result.
    Returns:
      (recv [recv_rows, ...], recv_sizes [P] int32).
    The custom call is CPU-only (an in-process rendezvous of the devices of
    one execution); "reference" is built from all_gather. Differentiable:
    the VJP is the reverse all-to-all (d_send from d_recv, offsets and sizes
    swapped), which assumes each rank's send ranges are disjoint.
    """
    num_ranks = send_sizes.shape[0] if send_sizes.ndim == 1 else -1
    for name, arr in (("send_offsets", send_offsets), ("send_sizes", send_sizes),
                      ("recv_offsets", recv_offsets)):
        check_index(arr, ALL_TO_ALL, name, (num_ranks,))
    check(send.ndim >= 1, ALL_TO_ALL, "send", "must have a leading row axis")
    check(recv_rows >= 0, ALL_TO_ALL, "recv_rows", f"must be >= 0, got {recv_rows}")
    if impl != "reference":
        require_handlers(ALL_TO_ALL, "cpu")
    attrs = _AllToAllAttrs(int(recv_rows), int(send.shape[0]), axis_name, impl)
    return _ragged_all_to_all(attrs, *same_varying(send, send_offsets, send_sizes,
                                                    recv_offsets, extra_axes=(axis_name,)))


class _AllToAllAttrs(NamedTuple):
    recv_rows: int
    send_rows: int
    axis_name: str
    impl: str


def _ragged_all_to_all_call(attrs: _AllToAllAttrs, send, send_offsets, send_sizes,
                            recv_offsets):
    if attrs.impl == "reference":
        return refs.ragged_all_to_all(send, send_offsets, send_sizes, recv_offsets,
                                      attrs.recv_rows, axis_name=attrs.axis_name)
    group = _group_index(attrs.axis_name)
    rank = jax.lax.axis_index(attrs.axis_name).astype(jnp.int32)
    out_types = (jax.ShapeDtypeStruct((attrs.recv_rows,) + send.shape[1:], send.dtype),
                 jax.ShapeDtypeStruct(send_sizes.shape, jnp.int32))
    call_attrs = dict(channel_id=np.int64(next(_channel_ids)))
    return call_ffi(ALL_TO_ALL, out_types,
                     (send, send_offsets, send_sizes, recv_offsets, rank, group),
                     call_attrs, extra_axes=(attrs.axis_name,), has_side_effect=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_all_to_all(attrs, send, send_offsets, send_sizes, recv_offsets):
    return _ragged_all_to_all_call(attrs, send, send_offsets, send_sizes, recv_offsets)


def _ragged_all_to_all_fwd(attrs, send, send_offsets, send_sizes, recv_offsets):
    recv, recv_sizes = _ragged_all_to_all_call(attrs, send, send_offsets, send_sizes,
                                               recv_offsets)
    return (recv, recv_sizes), (send_offsets, recv_offsets, recv_sizes)


def _ragged_all_to_all_bwd(attrs, residuals, cotangents):
    """The reverse all-to-all with the same counts: each rank sends the
    gradient of the rows it received back to their source, where it lands
    on the rows they were sent from (rows sent nowhere get zero)."""
    send_offsets, recv_offsets, recv_sizes = residuals
    d_recv, _ = cotangents
    reverse = _AllToAllAttrs(attrs.send_rows, attrs.recv_rows, attrs.axis_name, attrs.impl)
    d_send, _ = _ragged_all_to_all(reverse, d_recv, recv_offsets, recv_sizes, send_offsets)
    return d_send, None, None, None


_ragged_all_to_all.defvjp(_ragged_all_to_all_fwd, _ragged_all_to_all_bwd)


def all_to_all(x, *, axis_name: str, impl: str = "custom_call"):
    """Dense all-to-all of [P, C, ...] blocks: result[src] = x@src[rank]."""
    num_ranks, capacity = x.shape[0], x.shape[1]
    offsets = jnp.arange(num_ranks, dtype=jnp.int32) * capacity
    sizes = jnp.full((num_ranks,), capacity, jnp.int32)
    flat = x.reshape((num_ranks * capacity,) + x.shape[2:])
    recv, _ = ragged_all_to_all(flat, offsets, sizes, offsets, recv_rows=num_ranks * capacity,
                                axis_name=axis_name, impl=impl)
    return recv.reshape(x.shape)


def nccl_all_to_all(*buffers, axis_name: str):
    """Dense all-to-all of several [P, C_i, ...] buffers in one NCCL group.

    Call inside `jax.shard_map` on GPUs: result_i[src] = buffers_i@src[rank].
    Uses XLA's own NCCL communicator (FFI collectives extension), so it runs
    in one process or under jax.distributed alike, and it can be captured
    into a CUDA graph. All buffers share one NCCL group: one latency.
    Differentiable: the VJP is the same all-to-all of the cotangents.
    """
    check(len(buffers) >= 1, NCCL_ALL_TO_ALL, "buffers", "needs at least one buffer")
    groups = replica_groups(axis_name)
    for i, b in enumerate(buffers):
        check(b.ndim >= 2 and b.shape[0] == groups.shape[1], NCCL_ALL_TO_ALL,
               f"buffers[{i}]", f"must be [P={groups.shape[1]}, C, ...], got {list(b.shape)}")
    require_handlers(NCCL_ALL_TO_ALL, "gpu")
    return _nccl_all_to_all(axis_name, tuple(same_varying(*buffers, extra_axes=(axis_name,))))


def _nccl_all_to_all_call(axis_name: str, buffers: tuple) -> tuple:
    groups = replica_groups(axis_name)
    out_types = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers)
    attrs = dict(replica_groups=groups.reshape(-1), group_size=np.int64(groups.shape[1]),
                 communication_id=np.int64(0))
    results = call_ffi(NCCL_ALL_TO_ALL, out_types, buffers, attrs, extra_axes=(axis_name,),
                        has_side_effect=True)
    return tuple(results)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _nccl_all_to_all(axis_name, buffers):
    return _nccl_all_to_all_call(axis_name, buffers)


def _nccl_all_to_all_fwd(axis_name, buffers):
    return _nccl_all_to_all_call(axis_name, buffers), None


def _nccl_all_to_all_bwd(axis_name, _, cotangents):
    """A dense all-to-all is its own transpose: block src of the result came
    from block rank of src's buffer, so its gradient goes back the same way."""
    return (_nccl_all_to_all(axis_name, tuple(cotangents)),)


_nccl_all_to_all.defvjp(_nccl_all_to_all_fwd, _nccl_all_to_all_bwd)

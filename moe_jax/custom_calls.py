"""Typed wrappers of moe_jax's XLA FFI custom calls.

Semantics: docs/design/custom_calls.md; pure-JAX references: moe_jax/refs.py.
Shapes and dtypes are validated at trace time, naming the offending operand.
Each wrapper takes `impl`: "custom_call" (the FFI handler of the platform) or
"reference" (the pure-JAX reference, identical bits).

Every wrapper is differentiable (`jax.custom_vjp`, the same rule for both
impls): pack and combine are each other's transposes (moe_jax/transposes.py),
and an all-to-all's transpose is the reverse all-to-all with the same counts.
The backward calls are the same custom calls, so they keep static shapes,
need no host synchronization and are graph-capturable where the forward is.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import refs, transposes
from moe_jax.manual_axes import as_varying, same_varying, varying_axes

PACK = "moe_jax_pack"
COMBINE = "moe_jax_combine"
ALL_TO_ALL = "moe_jax_all_to_all"
NCCL_ALL_TO_ALL = "moe_jax_nccl_all_to_all"

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

_registered_platforms: dict[str, tuple[str, ...]] = {}
_load_errors: dict[str, str] = {}


def _register_module(module_name: str, platform: str) -> None:
    try:
        module = __import__(f"moe_jax.{module_name}", fromlist=["registrations"])
    except ImportError as err:
        _load_errors[platform] = str(err)
        return
    names = []
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
        names.append(name)
    _registered_platforms[platform] = tuple(sorted(names))


def register() -> dict[str, tuple[str, ...]]:
    """Registers the compiled handlers with XLA (idempotent, done at import).

    Returns {platform: target names} for the platforms whose handlers were
    built into this installation.
    """
    if not _registered_platforms and not _load_errors:
        _register_module("_ffi_cpu", "cpu")
        _register_module("_ffi_cuda", "CUDA")
    return dict(_registered_platforms)


def available_platforms() -> tuple[str, ...]:
    return tuple(p.lower() for p in register())


def _require_handlers(target: str, platform: str | None) -> None:
    platform = (platform or jax.default_backend()).lower()
    key = {"gpu": "cuda"}.get(platform, platform)
    registered = {p.lower(): names for p, names in register().items()}
    if target not in registered.get(key, ()):
        why = _load_errors.get("cpu" if key == "cpu" else "CUDA", "not built")
        raise RuntimeError(
            f"{target}: no {key} handler in this moe_jax installation ({why}). "
            "Rebuild with `pip install .` (CUDA handlers need nvcc at build time) or "
            "use kernel_impl='reference'.")


def _call_ffi(target: str, out_types, operands, attrs, extra_axes=(), **options):
    """ffi_call with operands and results typed as varying over the same
    manual axes (ffi_call itself demands equal input types inside shard_map
    and returns results that vary over nothing)."""
    axes = varying_axes(*operands) | frozenset(extra_axes)
    operands = [as_varying(o, axes) for o in operands]
    results = jax.ffi.ffi_call(target, out_types, **options)(*operands, **attrs)
    return jax.tree.map(lambda r: as_varying(r, axes), results)


def _check(cond: bool, target: str, operand: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{target}: operand '{operand}' {message}")


def _check_index(arr, target: str, operand: str, shape: tuple) -> None:
    _check(arr.dtype == jnp.int32 and tuple(arr.shape) == tuple(shape), target, operand,
           f"must be int32 of shape {tuple(shape)}, got {arr.dtype}{list(arr.shape)}")


def pack(x, sorted_slots, send_offsets, send_counts, *, top_k: int, start: int,
         capacity: int, spill_capacity: int, impl: str = "custom_call",
         platform: str | None = None):
    """Gathers token rows into per-destination capped and spill buffers.

    Args:
      x: [T, H] float32/bfloat16/float16 tokens.
      sorted_slots: [T * top_k] int32 slots in stream order (see plan.py).
      send_offsets, send_counts: [P] int32 stream starts and lengths.
      top_k, start, capacity, spill_capacity: static ints.
    Returns:
      cap_buf [P, capacity, H] and spill_buf [P, spill_capacity, H], dtype of
      x: stream positions [start, start+capacity) and the next
      spill_capacity positions; rows past a stream are zero.
    Graph-capturable on CUDA (one kernel launch, no allocation or sync).
    Differentiable in x: the VJP is a combine of the buffers' gradients
    with unit weights (float32 sum of a token's picks in pick order, in x's
    dtype); it assumes the streams are disjoint ranges of a permutation, as
    the plan makes them.
    """
    _check(x.ndim == 2 and x.dtype in FLOAT_DTYPES, PACK, "x",
           f"must be a [T, H] float32/bfloat16/float16 array, got {x.dtype}{list(x.shape)}")
    for name, value in (("top_k", top_k),):
        _check(value >= 1, PACK, name, f"must be >= 1, got {value}")
    for name, value in (("start", start), ("capacity", capacity),
                        ("spill_capacity", spill_capacity)):
        _check(value >= 0, PACK, name, f"must be >= 0, got {value}")
    num_ranks = send_counts.shape[0] if send_counts.ndim == 1 else -1
    _check_index(sorted_slots, PACK, "sorted_slots", (x.shape[0] * top_k,))
    _check_index(send_offsets, PACK, "send_offsets", (num_ranks,))
    _check_index(send_counts, PACK, "send_counts", (num_ranks,))
    attrs = _PackAttrs(int(top_k), int(start), int(capacity), int(spill_capacity), impl,
                       platform)
    if impl != "reference":
        _require_handlers(PACK, platform)
    return _pack(attrs, *same_varying(x, sorted_slots, send_offsets, send_counts))


class _PackAttrs(NamedTuple):
    top_k: int
    start: int
    capacity: int
    spill_capacity: int
    impl: str
    platform: str | None


def _pack_call(attrs: _PackAttrs, x, sorted_slots, send_offsets, send_counts):
    kwargs = dict(top_k=attrs.top_k, start=attrs.start, capacity=attrs.capacity,
                  spill_capacity=attrs.spill_capacity)
    if attrs.impl == "reference":
        return refs.pack(x, sorted_slots, send_offsets, send_counts, **kwargs)
    num_ranks, hidden = send_counts.shape[0], x.shape[1]
    out_types = (jax.ShapeDtypeStruct((num_ranks, attrs.capacity, hidden), x.dtype),
                 jax.ShapeDtypeStruct((num_ranks, attrs.spill_capacity, hidden), x.dtype))
    return _call_ffi(PACK, out_types, (x, sorted_slots, send_offsets, send_counts),
                     {k: np.int64(v) for k, v in kwargs.items()}, vmap_method="sequential")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pack(attrs, x, sorted_slots, send_offsets, send_counts):
    return _pack_call(attrs, x, sorted_slots, send_offsets, send_counts)


def _pack_fwd(attrs, x, sorted_slots, send_offsets, send_counts):
    out = _pack_call(attrs, x, sorted_slots, send_offsets, send_counts)
    return out, (sorted_slots, send_offsets, send_counts)


def _pack_bwd(attrs, residuals, cotangents):
    """pack's transpose is a combine with unit weights: each token's gradient
    is the float32 sum, in pick order, of its picks' window-row gradients."""
    sorted_slots, send_offsets, send_counts = residuals
    d_cap, d_spill = cotangents
    dest, pos = transposes.stream_positions(sorted_slots, send_offsets, send_counts)
    ones = jnp.ones((sorted_slots.shape[0] // attrs.top_k, attrs.top_k), jnp.float32)
    dx = combine(d_cap, d_spill, dest, pos, ones, start=attrs.start, out_dtype=d_cap.dtype,
                 impl=attrs.impl, platform=attrs.platform)
    return dx, None, None, None


_pack.defvjp(_pack_fwd, _pack_bwd)


def combine(cap_ret, spill_ret, dest, pos, weights, *, start: int, out_dtype,
            impl: str = "custom_call", platform: str | None = None):
    """Weighted merge of returned expert outputs back to token order.

    Args:
      cap_ret: [P, C, H] expert outputs in the layout pack wrote.
      spill_ret: [P, S, H] same dtype (S may be 0).
      dest, pos: [T * k] int32 destination rank and stream position per slot.
      weights: [T, k] float32 combine weights.
      start: stream position of cap_ret[:, 0].
      out_dtype: float32, bfloat16 or float16.
    Returns:
      [T, H] out_dtype; float32 accumulation over the k picks in order; picks
      outside both windows contribute nothing.
    Graph-capturable on CUDA (one kernel launch).
    Differentiable in cap_ret, spill_ret and weights (moe_jax/transposes.py):
    a row's gradient is weights[t, j] * g[t] for the pick (t, j) that read
    it (zero for rows nobody read), a weight's is the float32 dot of g[t]
    with the row its pick read. Assumes no two picks read the same row.
    """
    _check(cap_ret.ndim == 3 and cap_ret.dtype in FLOAT_DTYPES, COMBINE, "cap_ret",
           f"must be [P, C, H] float32/bfloat16/float16, got {cap_ret.dtype}{list(cap_ret.shape)}")
    num_ranks, _, hidden = cap_ret.shape
    _check(spill_ret.ndim == 3 and spill_ret.dtype == cap_ret.dtype
           and spill_ret.shape[0] == num_ranks and spill_ret.shape[2] == hidden,
           COMBINE, "spill_ret", f"must be [{num_ranks}, S, {hidden}] {cap_ret.dtype}, "
           f"got {spill_ret.dtype}{list(spill_ret.shape)}")
    _check(weights.ndim == 2 and weights.dtype == jnp.float32, COMBINE, "weights",
           f"must be [T, k] float32, got {weights.dtype}{list(weights.shape)}")
    num_slots = weights.shape[0] * weights.shape[1]
    _check_index(dest, COMBINE, "dest", (num_slots,))
    _check_index(pos, COMBINE, "pos", (num_slots,))
    out_dtype = jnp.dtype(out_dtype)
    _check(out_dtype in FLOAT_DTYPES, COMBINE, "out_dtype",
           f"must be float32/bfloat16/float16, got {out_dtype}")
    _check(start >= 0, COMBINE, "start", f"must be >= 0, got {start}")
    attrs = _CombineAttrs(int(start), out_dtype, impl, platform)
    if impl != "reference":
        _require_handlers(COMBINE, platform)
    return _combine(attrs, *same_varying(cap_ret, spill_ret, dest, pos, weights))


class _CombineAttrs(NamedTuple):
    start: int
    out_dtype: jnp.dtype
    impl: str
    platform: str | None


def _combine_call(attrs: _CombineAttrs, cap_ret, spill_ret, dest, pos, weights):
    if attrs.impl == "reference":
        return refs.combine(cap_ret, spill_ret, dest, pos, weights, start=attrs.start,
                            out_dtype=attrs.out_dtype)
    out_type = jax.ShapeDtypeStruct((weights.shape[0], cap_ret.shape[2]), attrs.out_dtype)
    return _call_ffi(COMBINE, out_type, (cap_ret, spill_ret, dest, pos, weights),
                     dict(start=np.int64(attrs.start)), vmap_method="sequential")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(attrs, cap_ret, spill_ret, dest, pos, weights):
    return _combine_call(attrs, cap_ret, spill_ret, dest, pos, weights)


def _combine_fwd(attrs, cap_ret, spill_ret, dest, pos, weights):
    out = _combine_call(attrs, cap_ret, spill_ret, dest, pos, weights)
    return out, (cap_ret, spill_ret, dest, pos, weights)


def _combine_bwd(attrs, residuals, g):
    """combine's transpose: the rows' gradient is a pack of the output
    gradient scaled by each pick's weight; the weights' is a per-pick dot of
    the output gradient with the row the pick read."""
    cap_ret, spill_ret, dest, pos, weights = residuals
    d_cap, d_spill, d_weights = transposes.combine_cotangents(
        g, cap_ret, spill_ret, dest, pos, weights, start=attrs.start)
    return d_cap, d_spill, None, None, d_weights


_combine.defvjp(_combine_fwd, _combine_bwd)


_channel_ids = itertools.count(1)


def _group_index(axis_name: str) -> jax.Array:
    """int32 index of this device's group along `axis_name`: the same for
    every rank of one group, distinct across groups (the other mesh axes'
    indices, row-major). The in-process rendezvous keys meetings by it."""
    mesh = jax.sharding.get_abstract_mesh()
    others = [n for n in getattr(mesh, "axis_names", ()) if n != axis_name and mesh.shape[n] > 1]
    auto = [n for n in others if n not in getattr(mesh, "manual_axes", ())]
    _check(not auto, ALL_TO_ALL, "axis_name",
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
        _check_index(arr, ALL_TO_ALL, name, (num_ranks,))
    _check(send.ndim >= 1, ALL_TO_ALL, "send", "must have a leading row axis")
    _check(recv_rows >= 0, ALL_TO_ALL, "recv_rows", f"must be >= 0, got {recv_rows}")
    if impl != "reference":
        _require_handlers(ALL_TO_ALL, "cpu")
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
    return _call_ffi(ALL_TO_ALL, out_types,
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


def replica_groups(axis_name: str) -> np.ndarray:
    """Device groups along `axis_name` of the current (shard_map) mesh.

    Returns [G, P] int64 flattened device ids (positions in the mesh's device
    order, which are XLA's partition ids), each row ordered by the axis index.
    """
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()))
    _check(axis_name in names, NCCL_ALL_TO_ALL, "axis_name",
           f"{axis_name!r} is not an axis of the current mesh {names}")
    shape = tuple(mesh.shape[n] for n in names)
    ids = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    axis = names.index(axis_name)
    return np.moveaxis(ids, axis, -1).reshape(-1, shape[axis])


def nccl_all_to_all(*buffers, axis_name: str):
    """Dense all-to-all of several [P, C_i, ...] buffers in one NCCL group.

    Call inside `jax.shard_map` on GPUs: result_i[src] = buffers_i@src[rank].
    Uses XLA's own NCCL communicator (FFI collectives extension), so it runs
    in one process or under jax.distributed alike, and it can be captured
    into a CUDA graph. All buffers share one NCCL group: one latency.
    Differentiable: the VJP is the same all-to-all of the cotangents.
    """
    _check(len(buffers) >= 1, NCCL_ALL_TO_ALL, "buffers", "needs at least one buffer")
    groups = replica_groups(axis_name)
    for i, b in enumerate(buffers):
        _check(b.ndim >= 2 and b.shape[0] == groups.shape[1], NCCL_ALL_TO_ALL,
               f"buffers[{i}]", f"must be [P={groups.shape[1]}, C, ...], got {list(b.shape)}")
    _require_handlers(NCCL_ALL_TO_ALL, "gpu")
    return _nccl_all_to_all(axis_name, tuple(same_varying(*buffers, extra_axes=(axis_name,))))


def _nccl_all_to_all_call(axis_name: str, buffers: tuple) -> tuple:
    groups = replica_groups(axis_name)
    out_types = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers)
    attrs = dict(replica_groups=groups.reshape(-1), group_size=np.int64(groups.shape[1]),
                 communication_id=np.int64(0))
    results = _call_ffi(NCCL_ALL_TO_ALL, out_types, buffers, attrs, extra_axes=(axis_name,),
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


register()

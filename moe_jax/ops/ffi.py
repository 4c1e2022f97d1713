"""The one FFI layer every moe_jax custom call goes through (internal API).

* Registration: `register()` loads the compiled handler modules
  (`moe_jax._ffi_cpu`, `moe_jax._ffi_cuda`) and registers every target
  they export with XLA, once; `available_platforms()` says which loaded;
  `require_handlers(target, platform)` raises a RuntimeError naming the
  target and why its handler is missing.
* The typed call: `call_ffi(target, out_types, operands, attrs, ...)` is
  `jax.ffi.ffi_call` with operands and results typed as varying over the
  same shard_map manual axes (`moe_jax.manual_axes`), which ffi_call
  demands of its inputs and does not give its results.
* Validation at trace time: `check` / `check_index` raise ValueError
  naming the target and the offending operand.
* `replica_groups(axis_name)`: the device groups along a mesh axis, the
  attribute every collective handler takes.

The op families sit beside it, each with its pure-JAX reference:
`pack_combine` (refs in moe_jax/refs.py), `all_to_all` (refs.py),
`grouped_matmul`, `moe_jax.row_invariant`, `moe_jax.nvlink`
(nvlink_reference.py) and `moe_jax.fast.staged_ffi`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.manual_axes import as_varying, same_varying, varying_axes  # noqa: F401

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


def require_handlers(target: str, platform: str | None) -> None:
    platform = (platform or jax.default_backend()).lower()
    key = {"gpu": "cuda"}.get(platform, platform)
    registered = {p.lower(): names for p, names in register().items()}
    if target not in registered.get(key, ()):
        why = _load_errors.get("cpu" if key == "cpu" else "CUDA", "not built")
        raise RuntimeError(
            f"{target}: no {key} handler in this moe_jax installation ({why}). "
            "Rebuild with `pip install .` (CUDA handlers need nvcc at build time) or "
            "use kernel_impl='reference'.")


def call_ffi(target: str, out_types, operands, attrs, extra_axes=(), invariant_results=(),
             **options):
    """`jax.ffi.ffi_call(target, out_types, **options)(*operands, **attrs)`
    with operands and results typed as varying over the same manual axes
    (the operands' union and extra_axes). Results whose index is in
    invariant_results keep ffi_call's invariant type (they are the same on
    every rank)."""
    axes = varying_axes(*operands) | frozenset(extra_axes)
    if any(o.size == 0 for o in operands):
        # XLA:CPU crashes compiling a custom call whose zero-sized operand is
        # a parameter of the computation (each primitive of an un-jitted
        # shard_map is one): build such operands inside one jitted call
        # (cached, so eager calls do not compile it again).
        shapes = tuple((o.shape, jnp.dtype(o.dtype)) if o.size == 0 else None
                       for o in operands)
        key = (target, _hashable(out_types), shapes, axes, _hashable(attrs),
               _hashable(options))
        try:
            hash(key)
        except TypeError:
            fn = _jit_with_empties.__wrapped__(target, out_types, shapes, axes, attrs, options)
        else:
            fn = _jit_with_empties(*key)
        results = fn(*[as_varying(o, axes) for o in operands if o.size])
    else:
        call = jax.ffi.ffi_call(target, out_types, **options)
        results = call(*[as_varying(o, axes) for o in operands], **attrs)
    if not isinstance(results, (tuple, list)):
        return as_varying(results, axes)
    return type(results)(r if i in invariant_results else as_varying(r, axes)
                         for i, r in enumerate(results))


def _hashable(value):
    """Dicts as sorted item tuples and lists as tuples, for cache keys."""
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


@functools.lru_cache(maxsize=256)
def _jit_with_empties(target, out_types, shapes, axes, attrs, options):
    """A jitted custom call whose zero-sized operands (`shapes[i]` not None)
    are built inside it; the other operands are its arguments."""
    attrs, options = dict(attrs), dict(options)
    call = jax.ffi.ffi_call(target, out_types, **options)

    def with_empties(*present):
        given = iter(present)
        return call(*[as_varying(jnp.zeros(*sd), axes) if sd else next(given)
                      for sd in shapes], **attrs)

    return jax.jit(with_empties)


def check(cond: bool, target: str, operand: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{target}: operand '{operand}' {message}")


def check_index(arr, target: str, operand: str, shape: tuple) -> None:
    check(arr.dtype == jnp.int32 and tuple(arr.shape) == tuple(shape), target, operand,
           f"must be int32 of shape {tuple(shape)}, got {arr.dtype}{list(arr.shape)}")


def replica_groups(axis_name: str) -> np.ndarray:
    """Device groups along `axis_name` of the current (shard_map) mesh.

    Returns [G, P] int64 flattened device ids (positions in the mesh's device
    order, which are XLA's partition ids), each row ordered by the axis index.
    """
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()))
    check(axis_name in names, "replica_groups", "axis_name",
           f"{axis_name!r} is not an axis of the current mesh {names}")
    shape = tuple(mesh.shape[n] for n in names)
    ids = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    axis = names.index(axis_name)
    return np.moveaxis(ids, axis, -1).reshape(-1, shape[axis])

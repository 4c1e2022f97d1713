"""Save and restore the example decoder's parameters with orbax-checkpoint.

Expert weights (``w_gate_up``, ``w_down``, stacked ``[E, ...]``) are saved
as they lie, split over the expert axis, and restored onto any mesh: the
target sharding is built for the *new* mesh, so a checkpoint written at one
expert-parallel size loads at another (orbax reads each device's slice of
the global array). Everything else is replicated. Checkpoints written before
the gate and up weights were fused (separate ``w_gate`` / ``w_up``
``[E, D, F]``) restore too: their two weights are read with the target
sharding and fused (``moe_jax.ops.grouped_matmul.fuse_gate_up``).

Layout of a checkpoint directory::

    <dir>/params/          orbax StandardCheckpointer tree (canonical params)
    <dir>/train_state/     a training state (save_state: params, optimizer
                           state, step; any pytree whose expert weights and
                           their optimizer moments sit under the names
                           w_gate_up, w_down)
    <dir>/decoder_config.json   the DecoderConfig fields, MoEConfig under "moe"
                                (shapes checked on restore)

    save_params(dir, params, cfg, mesh=mesh4)
    params = restore_params(dir, cfg, mesh=mesh8)        # resharded onto 8 ranks
    model = nnx_load_params(MixtralNnx(cfg, mesh=mesh8, rngs=nnx.Rngs(0)), params)

    save_state(dir, state, cfg, mesh=mesh4)              # e.g. models.train_linen
    state = restore_state(dir, abstract_state, cfg, mesh=mesh8)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding

from moe_jax.config import MoEConfig
from moe_jax.models.decoder import DecoderConfig, init_params
from moe_jax.models.sharding import param_shardings, shard_params
from moe_jax.ops.grouped_matmul import fuse_gate_up

__all__ = ["abstract_params", "load_config", "restore_params", "restore_state", "save_params",
           "save_state"]

_PARAMS = "params"
_STATE = "train_state"
_CONFIG = "decoder_config.json"
# Fields that fix parameter shapes and dtypes: a checkpoint restores only onto
# a config that agrees on them (strategy, capacities etc. may differ). Names
# under "moe." are MoEConfig fields.
_SHAPE_FIELDS = ("vocab_size", "d_model", "num_heads", "num_layers", "tie_embeddings",
                 "moe.num_experts", "moe.ffn_size", "moe.router", "moe.param_dtype")
_DTYPE_FIELDS = ("dtype", "param_dtype")


def _field(cfg: DecoderConfig, name: str) -> Any:
    value = cfg
    for part in name.split("."):
        value = getattr(value, part)
    return jnp.dtype(value) if part in _DTYPE_FIELDS else value


def _moe_json(moe: MoEConfig) -> dict:
    return {f.name: (jnp.dtype(getattr(moe, f.name)).name if f.name in _DTYPE_FIELDS
                     else getattr(moe, f.name)) for f in dataclasses.fields(moe)}


def _config_json(cfg: DecoderConfig) -> dict:
    """The DecoderConfig as JSON: its own fields, and "moe" (the MoEConfig fields)."""
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "moe"}
    out["moe"] = _moe_json(cfg.moe)
    return out


def _config_from_json(fields: dict) -> DecoderConfig:
    """Inverse of _config_json; also reads the flat layout (every MoE field at
    the top level, ``d_model`` for ``hidden_size``). Unknown names are dropped."""
    fields = dict(fields)
    moe = fields.pop("moe", None)
    if moe is None:  # flat layout
        moe, known = {}, {f.name for f in dataclasses.fields(MoEConfig)} | {"d_model"}
        for name in list(fields):
            if name in known:
                moe["hidden_size" if name == "d_model" else name] = fields.pop(name)
    moe = {k: v for k, v in moe.items() if k in {f.name for f in dataclasses.fields(MoEConfig)}}
    for name in _DTYPE_FIELDS:
        if name in moe:
            moe[name] = jnp.dtype(moe[name])
    own = {k: v for k, v in fields.items()
           if k in {f.name for f in dataclasses.fields(DecoderConfig)}}
    return DecoderConfig(**own, moe=MoEConfig(**moe))


def load_config(directory: str | os.PathLike) -> DecoderConfig | None:
    """The DecoderConfig saved with a checkpoint (None if none was saved)."""
    path = os.path.join(os.fspath(directory), _CONFIG)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return _config_from_json(json.load(f))


def save_params(directory: str | os.PathLike, params: Any, cfg: DecoderConfig | None = None,
                *, mesh: jax.sharding.Mesh | None = None, force: bool = False) -> str:
    """Writes canonical params (and `cfg`) to `directory`; returns its absolute path.

    Args:
      params: canonical params (``init_params`` / linen ``params`` /
        ``nnx_params(model)``), placed anywhere.
      cfg: the DecoderConfig, saved as JSON next to the params.
      mesh: if given, params are first laid out on it (expert weights split
        over ``cfg.moe.expert_axis``), so each device writes its own slice.
      force: overwrite an existing checkpoint.
    Under ``jax.distributed`` every process calls this (each writes the
    shards it holds; process 0 writes the config).
    """
    return _save(directory, _PARAMS, params, cfg, mesh, force)


def abstract_params(cfg: DecoderConfig, mesh: jax.sharding.Mesh | None = None) -> Any:
    """ShapeDtypeStructs of the canonical params, with the shardings they get
    on `mesh` (expert weights split over cfg.moe.expert_axis; one device without
    a mesh)."""
    shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
    if mesh is not None and cfg.moe.expert_axis in mesh.axis_names:
        cfg.moe.experts_per_rank(mesh.shape[cfg.moe.expert_axis])
    return _placed(shapes, cfg, mesh)


def _placed(shapes: Any, cfg: DecoderConfig | None, mesh: jax.sharding.Mesh | None) -> Any:
    """`shapes` as ShapeDtypeStructs with the shardings they get on `mesh`
    (expert weights and their optimizer moments split over the expert axis,
    the rest replicated; one device without a mesh)."""
    if mesh is None:
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, shapes)
    else:
        shardings = param_shardings(shapes, mesh, _expert_axis(cfg))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def _save(directory, item_name: str, tree: Any, cfg: DecoderConfig | None,
          mesh: jax.sharding.Mesh | None, force: bool) -> str:
    """Writes `tree` (laid out on `mesh` first, so each device writes its
    slice) under directory/item_name, and `cfg` beside it."""
    directory = os.path.abspath(os.fspath(directory))
    tree = nn.meta.unbox(tree)
    if mesh is not None:
        tree = shard_params(tree, mesh, _expert_axis(cfg))
    os.makedirs(directory, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(directory, item_name), tree, force=force)
        ckptr.wait_until_finished()
    _write_config(directory, cfg)
    return directory


def _write_config(directory: str, cfg: DecoderConfig | None) -> None:
    if cfg is not None and jax.process_index() == 0:
        with open(os.path.join(directory, _CONFIG), "w", encoding="utf-8") as f:
            json.dump(_config_json(cfg), f, indent=1, default=str)


def _check_config(directory: str, cfg: DecoderConfig | None) -> DecoderConfig | None:
    """cfg, or the saved one; raises if they disagree on parameter shapes."""
    saved = load_config(directory)
    if cfg is None:
        return saved
    if saved is not None:
        for name in _SHAPE_FIELDS:
            a, b = _field(saved, name), _field(cfg, name)
            if a != b:
                raise ValueError(f"cfg: {name}={b!r} differs from the checkpoint's {a!r}")
    return cfg


def _expert_axis(cfg: DecoderConfig | None) -> str:
    return cfg.moe.expert_axis if cfg is not None else "ep"


def save_state(directory: str | os.PathLike, state: Any, cfg: DecoderConfig | None = None,
               *, mesh: jax.sharding.Mesh | None = None, force: bool = False) -> str:
    """Writes a training state (e.g. {"params", "opt_state", "step"} of
    moe_jax.models.train_linen, or train_nnx.state_tree) to
    `directory`/train_state and `cfg` next to it; returns the directory.

    Leaves under the expert weights' names (w_gate_up, w_down: the weights
    and the optimizer's moments of them) are laid out split over the expert
    axis of `mesh` first, so each device writes its slice; the rest is
    replicated. Under jax.distributed every process calls this.
    """
    return _save(directory, _STATE, state, cfg, mesh, force)


def restore_state(directory: str | os.PathLike, abstract_state: Any,
                  cfg: DecoderConfig | None = None,
                  mesh: jax.sharding.Mesh | None = None) -> Any:
    """Reads a training state written by save_state, laid out for `mesh`
    (any expert-parallel size: leaves under the expert weights' names split
    over cfg.moe.expert_axis, the rest replicated; one device without a mesh).

    abstract_state: the state's ShapeDtypeStructs (jax.eval_shape of the code
    that builds it, e.g. train_linen.abstract_state); shardings are ignored.
    Raises ValueError when there is no state or `cfg` disagrees with the
    saved config on parameter shapes.
    """
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(os.path.join(directory, _STATE)):
        raise ValueError(f"directory: no training state in {directory}")
    cfg = _check_config(directory, cfg)
    target = _placed(abstract_state, cfg, mesh)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.join(directory, _STATE), target)


def restore_params(directory: str | os.PathLike, cfg: DecoderConfig | None = None,
                   mesh: jax.sharding.Mesh | None = None) -> Any:
    """Reads canonical params, laid out for `mesh` (any expert-parallel size).

    Args:
      cfg: the config to restore for (default: the one saved with the
        checkpoint); must agree with the saved one on the parameter shapes.
      mesh: target mesh; expert weights are split over cfg.moe.expert_axis
        (E must divide by its size).
    Raises:
      ValueError: no checkpoint, or `cfg` disagrees with the saved config.
    """
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(os.path.join(directory, _PARAMS)):
        raise ValueError(f"directory: no checkpoint in {directory}")
    cfg = _check_config(directory, cfg)
    if cfg is None:
        raise ValueError("cfg: the checkpoint holds no config; pass one")
    path = os.path.join(directory, _PARAMS)
    target = abstract_params(cfg, mesh)
    with ocp.StandardCheckpointer() as ckptr:
        saved_tree = ckptr.metadata(path).item_metadata.tree
        legacy = _has_separate_gate_up(saved_tree)
        restored = ckptr.restore(path, _separate_gate_up(target) if legacy else target)
    return _fuse_gate_up(restored) if legacy else restored


def _has_separate_gate_up(tree) -> bool:
    return any(isinstance(node, dict) and "w_gate" in node and "w_up" in node
               for node in _dicts(tree))


def _dicts(tree):
    if isinstance(tree, dict):
        yield tree
        for value in tree.values():
            yield from _dicts(value)


def _map_moe(tree, fn):
    """Applies fn to every dict holding expert weights (the "moe" dicts)."""
    if not isinstance(tree, dict):
        return tree
    out = {k: _map_moe(v, fn) for k, v in tree.items()}
    return fn(out) if "w_down" in out else out


def _separate_gate_up(target):
    """The abstract tree with each w_gate_up [E, D, 2F] as w_gate / w_up [E, D, F]."""
    def split(moe):
        if "w_gate_up" not in moe:
            return moe
        moe = dict(moe)
        fused = moe.pop("w_gate_up")
        e, d, two_f = fused.shape
        half = jax.ShapeDtypeStruct((e, d, two_f // 2), fused.dtype, sharding=fused.sharding)
        moe["w_gate"], moe["w_up"] = half, half
        return moe
    return _map_moe(target, split)


def _fuse_gate_up(restored):
    """Fuses restored w_gate / w_up into w_gate_up, sharded as they were read."""
    def fuse(moe):
        if "w_gate" not in moe:
            return moe
        moe = dict(moe)
        gate, up = moe.pop("w_gate"), moe.pop("w_up")
        moe["w_gate_up"] = jax.jit(fuse_gate_up, out_shardings=gate.sharding)(gate, up)
        return moe
    return _map_moe(restored, fuse)

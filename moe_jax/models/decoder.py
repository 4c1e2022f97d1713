"""A small Mixtral-style decoder built on the library's MoE layer.

Three implementations share one parameter layout (a nested dict, the
"canonical params"):

* :func:`forward`: a pure function over canonical params (the reference),
  calling :func:`moe_jax.moe_layer` directly;
* :class:`MixtralLinen`: a Flax linen module whose ``params`` collection *is*
  the canonical layout (``MixtralLinen(cfg).apply({"params": p}, ...)``
  takes the output of :func:`init_params` unchanged);
* :class:`MixtralNnx`: a Flax nnx module; :func:`nnx_load_params` copies
  canonical params into it and :func:`nnx_params` reads them back.

Layout (``L`` = layers, ``V`` vocab, ``D`` d_model, ``N`` heads, ``K``
head dim, ``E`` experts, ``F`` expert width)::

    embed [V, D]
    layers_{i}: attn_norm [D], wq/wk/wv [D, N, K], wo [N, K, D], mlp_norm [D],
                moe: router [D, E], (router_bias [E]), w_gate_up [E, D, 2F]
                     (gate and up fused, see ExpertWeights), w_down [E, F, D]
    final_norm [D]
    lm_head [D, V]            (only when tie_embeddings is False)

One call processes ``S`` new tokens per sequence, writes their keys and
values into a fixed-length KV cache at slot ``index`` and attends to every
valid slot up to its own (causal over slots; left-padded prompts are masked
out with ``kv_valid``). Shapes are static, so prefill (``S`` = prompt
length) and decode (``S`` = 1) each compile once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.config import MoEConfig
from moe_jax.dispatch import DispatchStats
from moe_jax.experts import ExpertWeights
from moe_jax.layer import MoEParams, moe_layer
from moe_jax.nn import linen as moe_linen
from moe_jax.nn import nnx as moe_nnx
from moe_jax.nn.init import expert_init, router_init
from moe_jax.ops.grouped_matmul import fuse_gate_up
from moe_jax.replicated import slot_weights
from moe_jax.replication import Placement
from moe_jax.routing import route, router_logits

__all__ = [
    "DecoderConfig", "KVCache", "ModelOutput", "MixtralLinen", "MixtralNnx",
    "forward", "init_cache", "init_params", "linen_stats", "nnx_load_params", "nnx_params",
    "EXPERT_PARAM_NAMES",
]

#: Parameter names of the expert weights (sharded over the expert axis).
EXPERT_PARAM_NAMES = ("w_gate_up", "w_down")
# Expert weights of checkpoints written before gate and up were fused.
LEGACY_EXPERT_PARAM_NAMES = ("w_gate", "w_up")
_ATTN_NAMES = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm")
_MASK_VALUE = -1e9  # finite, so fully masked rows (pad queries) stay NaN-free


def _positive_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


# MoEConfig defaults that differ for the decoder: it runs the dense reference
# in float32 unless told otherwise.
_MOE_DEFAULTS = dict(hidden_size=32, ffn_size=64, num_experts=8, top_k=2, strategy="dense",
                     dtype=jnp.float32, param_dtype=jnp.float32)


def _default_moe() -> MoEConfig:
    return MoEConfig(**_MOE_DEFAULTS)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shapes of the decoder around one MoE layer configuration.

    Attributes:
      vocab_size, num_heads, num_layers, max_len (KV cache slots: prompt plus
        generated tokens).
      tie_embeddings: LM head = embedding transposed (else a separate
        ``lm_head``).
      rope_theta, norm_eps: RoPE base and RMSNorm epsilon.
      moe: the MoEConfig of every block's MoE layer. Its ``hidden_size`` is
        the model width (``d_model``), its ``dtype`` the activation dtype of
        the whole model (attention too) and its ``param_dtype`` the dtype of
        every parameter.

    Build one with :meth:`create`, which takes the decoder fields and the
    MoEConfig fields as keyword arguments in one call (``d_model`` for
    ``hidden_size``); :meth:`replace` accepts both kinds too::

        cfg = DecoderConfig.create(vocab_size=256, d_model=64, num_heads=4,
                                   num_layers=2, max_len=32, num_experts=8,
                                   strategy="ragged")
        cfg.replace(strategy="cap_and_spill", capacity=4, spill_capacity=2)
    """

    vocab_size: int = 64
    num_heads: int = 4
    num_layers: int = 2
    max_len: int = 32
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    moe: MoEConfig = dataclasses.field(default_factory=_default_moe)

    def __post_init__(self) -> None:
        if not isinstance(self.moe, MoEConfig):
            raise ValueError(f"DecoderConfig.moe: must be a MoEConfig, got "
                             f"{type(self.moe).__name__}")
        for name in ("vocab_size", "num_heads", "num_layers", "max_len"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise ValueError(f"DecoderConfig.{name}: must be a positive integer, "
                                 f"got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"DecoderConfig.num_heads: d_model={self.d_model} is not a "
                             f"multiple of num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.num_heads: head dim {self.head_dim} must be even "
                             "for RoPE")
        if not self.rope_theta > 0:
            raise ValueError(f"DecoderConfig.rope_theta: must be > 0, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"DecoderConfig.norm_eps: must be > 0, got {self.norm_eps!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError("DecoderConfig.tie_embeddings: must be a bool, got "
                             f"{self.tie_embeddings!r}")

    @classmethod
    def create(cls, **fields) -> "DecoderConfig":
        """A DecoderConfig from decoder and MoEConfig keyword arguments.

        Decoder fields (``vocab_size``, ``num_heads``, ...) set the decoder;
        ``d_model`` sets ``moe.hidden_size``; every other MoEConfig field
        (``num_experts``, ``top_k``, ``ffn_size``, ``strategy``, ``capacity``,
        ``dtype``, ...) sets ``moe``. Unset MoE fields take the decoder's
        defaults (d_model 32, ffn_size 64, 8 experts, top-2, the "dense"
        strategy, float32) or else MoEConfig's.
        """
        own, moe = _split_fields(fields)
        return cls(**own, moe=MoEConfig(**{**_MOE_DEFAULTS, **moe}))

    def replace(self, **changes) -> "DecoderConfig":
        """A copy with decoder and/or MoEConfig fields changed (as in :meth:`create`)."""
        own, moe = _split_fields(changes)
        if moe:
            own["moe"] = own.get("moe", self.moe).replace(**moe)
        return dataclasses.replace(self, **own)

    @property
    def d_model(self) -> int:
        """Model width (``moe.hidden_size``)."""
        return self.moe.hidden_size

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def dtype(self) -> Any:
        """Activation dtype of the whole model (``moe.dtype``)."""
        return self.moe.dtype

    @property
    def param_dtype(self) -> Any:
        """Dtype of every parameter (``moe.param_dtype``)."""
        return self.moe.param_dtype


_DECODER_FIELDS = frozenset(f.name for f in dataclasses.fields(DecoderConfig))
_MOE_FIELDS = frozenset(f.name for f in dataclasses.fields(MoEConfig))


def _split_fields(fields: dict) -> tuple[dict, dict]:
    """Keyword arguments -> (DecoderConfig fields, MoEConfig fields)."""
    own, moe = {}, {}
    for name, value in fields.items():
        if name == "d_model":
            moe["hidden_size"] = value
        elif name in _DECODER_FIELDS:
            own[name] = value
        elif name in _MOE_FIELDS:
            moe[name] = value
        else:
            raise ValueError(f"DecoderConfig.{name}: not a field of DecoderConfig or "
                             "MoEConfig")
    return own, moe


class KVCache(NamedTuple):
    """k, v: [layers, batch, max_len, heads, head_dim]."""

    k: jax.Array
    v: jax.Array


class ModelOutput(NamedTuple):
    """logits [B, S, V] float32; cache; stats: DispatchStats summed over the
    layers; expert_ids / gating [layers, B*S, top_k] (None unless recorded)."""

    logits: jax.Array
    cache: KVCache
    stats: DispatchStats
    expert_ids: jax.Array | None = None
    gating: jax.Array | None = None


def init_cache(cfg: DecoderConfig, batch: int) -> KVCache:
    shape = (cfg.num_layers, batch, cfg.max_len, cfg.num_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))


# --------------------------------------------------------------------------
# Shared pieces (pure functions)
# --------------------------------------------------------------------------

def _normal(scale_axis: int):
    def init(key, shape, dtype=jnp.float32):
        return (jax.random.normal(key, shape) * shape[scale_axis] ** -0.5).astype(dtype)
    return init


def _attn_inits(cfg: DecoderConfig):
    d, n, k = cfg.d_model, cfg.num_heads, cfg.head_dim
    return {
        "attn_norm": (nn.initializers.ones, (d,)),
        "wq": (_normal(0), (d, n, k)),
        "wk": (_normal(0), (d, n, k)),
        "wv": (_normal(0), (d, n, k)),
        "wo": (lambda key, shape, dtype=jnp.float32:
               (jax.random.normal(key, shape) * d ** -0.5).astype(dtype), (n, k, d)),
        "mlp_norm": (nn.initializers.ones, (d,)),
    }


def _embed_init(key, shape, dtype=jnp.float32):
    return jax.random.normal(key, shape, dtype=jnp.float32).astype(dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) \
        * scale.astype(jnp.float32)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of x [B, S, N, K] at positions [B, S] (rotate-half form)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None, None] * freqs  # [B, S, 1, K/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(p: dict, x: jax.Array, positions: jax.Array, cache_k: jax.Array,
              cache_v: jax.Array, index: jax.Array, kv_valid: jax.Array,
              cfg: DecoderConfig):
    """Causal multi-head attention with RoPE over a fixed-length cache.

    x [B, S, D] (already normed); positions [B, S]; cache_k/v [B, M, N, K];
    index: slot of x's first token; kv_valid [B, M] (False for padding).
    Returns (out [B, S, D], cache_k, cache_v).
    """
    dt = cfg.dtype
    x = x.astype(dt)
    q = jnp.einsum("bsd,dnk->bsnk", x, p["wq"].astype(dt))
    k = jnp.einsum("bsd,dnk->bsnk", x, p["wk"].astype(dt))
    v = jnp.einsum("bsd,dnk->bsnk", x, p["wv"].astype(dt))
    q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    zero = jnp.zeros((), jnp.int32)
    index = jnp.asarray(index, jnp.int32)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype),
                                           (zero, index, zero, zero))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype),
                                           (zero, index, zero, zero))
    scores = jnp.einsum("bsnk,bmnk->bnsm", q.astype(jnp.float32),
                        cache_k.astype(jnp.float32)) * cfg.head_dim ** -0.5
    slots = jnp.arange(cfg.max_len)
    query_slots = index + jnp.arange(x.shape[1])
    mask = kv_valid[:, None, None, :] & (slots[None, None, None, :]
                                         <= query_slots[None, None, :, None])
    probs = jax.nn.softmax(jnp.where(mask, scores, _MASK_VALUE), axis=-1)
    out = jnp.einsum("bnsm,bmnk->bsnk", probs, cache_v.astype(jnp.float32)).astype(dt)
    return jnp.einsum("bsnk,nkd->bsd", out, p["wo"].astype(dt)), cache_k, cache_v


def _routing_record(h: jax.Array, router: jax.Array, bias, moe_cfg: MoEConfig):
    """The routing the MoE layer applies to h [B, S, D]: (expert_ids, weights)
    [B*S, k], weights renormalized to sum to 1."""
    tokens = h.reshape(-1, h.shape[-1]).astype(moe_cfg.dtype)
    r = route(router_logits(tokens, router, moe_cfg), moe_cfg, bias)
    return r.expert_ids, r.weights / jnp.sum(r.weights, axis=-1, keepdims=True)


def _head(x, params_embed, lm_head, final_norm, cfg: DecoderConfig) -> jax.Array:
    h = rms_norm(x, final_norm, cfg.norm_eps)
    w = params_embed.T if cfg.tie_embeddings else lm_head
    return jnp.dot(h, w.astype(jnp.float32))


def init_params(key: jax.Array, cfg: DecoderConfig) -> dict:
    """Random canonical params (unsharded; see the module docstring)."""
    moe_cfg = cfg.moe
    dt = cfg.param_dtype
    keys = jax.random.split(key, cfg.num_layers + 2)
    params: dict = {"embed": _embed_init(keys[0], (cfg.vocab_size, cfg.d_model), dt)}
    for i in range(cfg.num_layers):
        lk = jax.random.split(keys[i + 1], 8)
        layer = {}
        for j, (name, (init, shape)) in enumerate(_attn_inits(cfg).items()):
            layer[name] = init(lk[j], shape, dt)
        d, f, e = cfg.d_model, moe_cfg.ffn_size, moe_cfg.num_experts
        ek = jax.random.split(lk[6], 4)
        moe = {"router": router_init(ek[0], (d, e), dt)}
        if moe_cfg.router == "sigmoid_grouped":
            moe["router_bias"] = jnp.zeros((e,), dt)
        moe["w_gate_up"] = fuse_gate_up(expert_init(ek[1], (e, d, f), dt),
                                        expert_init(ek[2], (e, d, f), dt))
        moe["w_down"] = expert_init(ek[3], (e, f, d), dt)
        layer["moe"] = moe
        params[f"layers_{i}"] = layer
    params["final_norm"] = jnp.ones((cfg.d_model,), dt)
    if not cfg.tie_embeddings:
        params["lm_head"] = _normal(0)(keys[-1], (cfg.d_model, cfg.vocab_size), dt)
    return params


def _sum_stats(stats: list[DispatchStats]) -> DispatchStats:
    total = DispatchStats.zeros()
    for s in stats:
        total = total + s
    return total


def _stack_routing(records):
    if not records:
        return None, None
    return (jnp.stack([r[0] for r in records]), jnp.stack([r[1] for r in records]))


def forward(params: dict, tokens: jax.Array, positions: jax.Array, cache: KVCache,
            index: jax.Array, kv_valid: jax.Array, cfg: DecoderConfig,
            mesh: jax.sharding.Mesh | None = None, *, record: bool = False,
            placements=None) -> ModelOutput:
    """The reference decoder as a pure function (moe_jax.moe_layer for the MoE).

    tokens, positions [B, S] int; cache: KVCache; index: cache slot of the
    first token; kv_valid [B, max_len] bool; mesh: for expert parallelism;
    placements: one PlacementArrays per layer (hot-expert replication; the
    params then hold slot weights, see :func:`replicate_params`) or None.
    """
    moe_cfg = cfg.moe
    x = jnp.take(params["embed"], tokens, axis=0).astype(jnp.float32)
    new_k, new_v, stats, records = [], [], [], []
    for i in range(cfg.num_layers):
        p = params[f"layers_{i}"]
        a, ck, cv = attention(p, rms_norm(x, p["attn_norm"], cfg.norm_eps), positions,
                              cache.k[i], cache.v[i], index, kv_valid, cfg)
        x = x + a.astype(jnp.float32)
        h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
        m = p["moe"]
        moe_params = MoEParams(m["router"], m.get("router_bias"),
                               ExpertWeights(m["w_gate_up"], m["w_down"]))
        y, aux = moe_layer(moe_params, h.astype(cfg.dtype), moe_cfg, mesh,
                           placement=None if placements is None else placements[i])
        if record:
            records.append(_routing_record(h, m["router"], m.get("router_bias"), moe_cfg))
        x = x + y.astype(jnp.float32)
        new_k.append(ck)
        new_v.append(cv)
        stats.append(aux.stats)
    logits = _head(x, params["embed"], params.get("lm_head"), params["final_norm"], cfg)
    return ModelOutput(logits, KVCache(jnp.stack(new_k), jnp.stack(new_v)),
                       _sum_stats(stats), *_stack_routing(records))


# --------------------------------------------------------------------------
# Flax linen
# --------------------------------------------------------------------------

class _LinenBlock(nn.Module):
    cfg: DecoderConfig
    mesh: jax.sharding.Mesh | None = None
    replica_choice: str = "local"

    @nn.compact
    def __call__(self, x, positions, cache_k, cache_v, index, kv_valid, record=False,
                 placement=None):
        cfg = self.cfg
        p = {name: self.param(name, init, shape, cfg.param_dtype)
             for name, (init, shape) in _attn_inits(cfg).items()}
        a, ck, cv = attention(p, rms_norm(x, p["attn_norm"], cfg.norm_eps), positions,
                              cache_k, cache_v, index, kv_valid, cfg)
        x = x + a.astype(jnp.float32)
        h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
        moe = moe_linen.MoE(cfg.moe, self.mesh, self.replica_choice, name="moe")
        y = moe(h.astype(cfg.dtype), placement)
        rec = None
        if record:
            mp = moe.variables["params"]
            rec = _routing_record(h, nn.meta.unbox(mp["router"]),
                                  nn.meta.unbox(mp.get("router_bias")), cfg.moe)
        return x + y.astype(jnp.float32), ck, cv, rec


class MixtralLinen(nn.Module):
    """The decoder as a linen module; its params are the canonical layout.

    Call: (tokens, positions, cache, index, kv_valid, record=False,
    placements=None) -> ModelOutput. Dispatch statistics are summed from the
    MoE layers' "moe_stats" collection when it is mutable (else zeros).
    placements: one PlacementArrays per layer (hot-expert replication; the
    params then hold slot weights, see :func:`replicate_params`), each pick
    choosing a replica by `replica_choice` ("local" or "balanced", see
    moe_jax.moe_layer).
    """

    cfg: DecoderConfig
    mesh: jax.sharding.Mesh | None = None
    replica_choice: str = "local"

    @nn.compact
    def __call__(self, tokens, positions, cache: KVCache, index, kv_valid,
                 record: bool = False, placements=None) -> ModelOutput:
        cfg = self.cfg
        embed = self.param("embed", _embed_init, (cfg.vocab_size, cfg.d_model),
                           cfg.param_dtype)
        x = jnp.take(embed, tokens, axis=0).astype(jnp.float32)
        new_k, new_v, records = [], [], []
        for i in range(cfg.num_layers):
            x, ck, cv, rec = _LinenBlock(cfg, self.mesh, self.replica_choice,
                                         name=f"layers_{i}")(
                x, positions, cache.k[i], cache.v[i], index, kv_valid, record,
                None if placements is None else placements[i])
            new_k.append(ck)
            new_v.append(cv)
            if rec is not None:
                records.append(rec)
        final_norm = self.param("final_norm", nn.initializers.ones, (cfg.d_model,),
                                cfg.param_dtype)
        lm_head = None
        if not cfg.tie_embeddings:
            lm_head = self.param("lm_head", _normal(0), (cfg.d_model, cfg.vocab_size),
                                 cfg.param_dtype)
        logits = _head(x, embed, lm_head, final_norm, cfg)
        stats = DispatchStats.zeros()  # see linen_stats for the per-layer counters
        return ModelOutput(logits, KVCache(jnp.stack(new_k), jnp.stack(new_v)), stats,
                           *_stack_routing(records))


def linen_stats(mutated: dict, cfg: DecoderConfig) -> DispatchStats:
    """DispatchStats summed over the layers from the "moe_stats" collection
    returned by ``MixtralLinen.apply(..., mutable=["moe_stats"])``."""
    coll = mutated.get("moe_stats", {})
    found = [coll[f"layers_{i}"]["moe"]["dispatch"] for i in range(cfg.num_layers)
             if f"layers_{i}" in coll]
    return _sum_stats([DispatchStats(*s) for s in found])


# --------------------------------------------------------------------------
# Flax nnx
# --------------------------------------------------------------------------

class _NnxBlock(nnx.Module):
    def __init__(self, cfg: DecoderConfig, mesh, rngs: nnx.Rngs, placement=None,
                 replica_choice: str = "local"):
        self.cfg = cfg
        for name, (init, shape) in _attn_inits(cfg).items():
            setattr(self, name, nnx.Param(init(rngs.params(), shape, cfg.param_dtype)))
        self.moe = moe_nnx.MoE(cfg.moe, mesh=mesh, rngs=rngs, placement=placement,
                               replica_choice=replica_choice)

    def __call__(self, x, positions, cache_k, cache_v, index, kv_valid, record=False):
        cfg = self.cfg
        p = {name: getattr(self, name)[...] for name in _ATTN_NAMES}
        a, ck, cv = attention(p, rms_norm(x, p["attn_norm"], cfg.norm_eps), positions,
                              cache_k, cache_v, index, kv_valid, cfg)
        x = x + a.astype(jnp.float32)
        h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
        before = self.moe.stats.get_value()
        y = self.moe(h.astype(cfg.dtype))
        stats = jax.tree.map(lambda a, b: a - b, self.moe.stats.get_value(), before)
        stats = stats._replace(max_peer_rows=self.moe.stats.get_value().max_peer_rows)
        rec = None
        if record:
            mp = self.moe.params()
            rec = _routing_record(h, mp.router, mp.router_bias, cfg.moe)
        return x + y.astype(jnp.float32), ck, cv, rec, stats


class MixtralNnx(nnx.Module):
    """The decoder as an nnx module (same math and parameter names as
    MixtralLinen; load canonical params with :func:`nnx_load_params`).

    Call: (tokens, positions, cache, index, kv_valid, record=False) ->
    ModelOutput (stats: this call's DispatchStats summed over the layers;
    max_peer_rows is the running maximum kept by the MoE modules).
    placements: one moe_jax.replication.Placement per layer (hot-expert
    replication: each MoE module holds slot weights and its placement);
    replica_choice: "local" or "balanced" (see moe_jax.moe_layer).
    """

    def __init__(self, cfg: DecoderConfig, *, mesh: jax.sharding.Mesh | None = None,
                 rngs: nnx.Rngs, placements: list[Placement] | None = None,
                 replica_choice: str = "local"):
        self.cfg = cfg
        self.mesh = mesh
        self.embed = nnx.Param(_embed_init(rngs.params(), (cfg.vocab_size, cfg.d_model),
                                           cfg.param_dtype))
        if placements is not None and len(placements) != cfg.num_layers:
            raise ValueError(f"placements: one per layer ({cfg.num_layers}), got "
                             f"{len(placements)}")
        self.layers = nnx.List([_NnxBlock(cfg, mesh, rngs,
                                          None if placements is None else placements[i],
                                          replica_choice)
                                for i in range(cfg.num_layers)])
        self.final_norm = nnx.Param(jnp.ones((cfg.d_model,), cfg.param_dtype))
        self.lm_head = nnx.data(None if cfg.tie_embeddings else nnx.Param(
            _normal(0)(rngs.params(), (cfg.d_model, cfg.vocab_size), cfg.param_dtype)))

    def __call__(self, tokens, positions, cache: KVCache, index, kv_valid,
                 record: bool = False) -> ModelOutput:
        cfg = self.cfg
        embed = self.embed[...]
        x = jnp.take(embed, tokens, axis=0).astype(jnp.float32)
        new_k, new_v, records, stats = [], [], [], []
        for i, block in enumerate(self.layers):
            x, ck, cv, rec, st = block(x, positions, cache.k[i], cache.v[i], index, kv_valid,
                                       record)
            new_k.append(ck)
            new_v.append(cv)
            stats.append(st)
            if rec is not None:
                records.append(rec)
        lm_head = None if self.lm_head is None else self.lm_head[...]
        logits = _head(x, embed, lm_head, self.final_norm[...], cfg)
        return ModelOutput(logits, KVCache(jnp.stack(new_k), jnp.stack(new_v)),
                           _sum_stats(stats), *_stack_routing(records))


def _moe_names(cfg: DecoderConfig) -> tuple[str, ...]:
    bias = ("router_bias",) if cfg.moe.router == "sigmoid_grouped" else ()
    return ("router",) + bias + EXPERT_PARAM_NAMES


def nnx_params(model: MixtralNnx) -> dict:
    """The canonical params of an nnx model (arrays shared, not copied)."""
    cfg = model.cfg
    out: dict = {"embed": model.embed[...]}
    for i, block in enumerate(model.layers):
        layer = {name: getattr(block, name)[...] for name in _ATTN_NAMES}
        layer["moe"] = {name: getattr(block.moe, name)[...] for name in _moe_names(cfg)}
        out[f"layers_{i}"] = layer
    out["final_norm"] = model.final_norm[...]
    if model.lm_head is not None:
        out["lm_head"] = model.lm_head[...]
    return out


def replicate_params(params: dict, placements: list[Placement]) -> dict:
    """Canonical params with every layer's expert weights ([E, ...]) copied
    onto the slots of its placement ([P * S, ...], moe_jax.replicated
    .slot_weights); the rest shared."""
    out = dict(params)
    for i, placement in enumerate(placements):
        layer = dict(out[f"layers_{i}"])
        moe = dict(layer["moe"])
        experts = slot_weights(ExpertWeights(moe["w_gate_up"], moe["w_down"]), placement)
        moe["w_gate_up"], moe["w_down"] = experts.w_gate_up, experts.w_down
        layer["moe"] = moe
        out[f"layers_{i}"] = layer
    return out


def nnx_load_params(model: MixtralNnx, params: dict) -> MixtralNnx:
    """Copies canonical params into `model` (in place; returns it)."""
    def put(var, value):
        if tuple(var.shape) != tuple(value.shape):
            raise ValueError(f"params: shape {tuple(value.shape)} does not match the "
                             f"model's {tuple(var.shape)}")
        var.set_value(jnp.asarray(value))

    cfg = model.cfg
    put(model.embed, params["embed"])
    for i, block in enumerate(model.layers):
        layer = params[f"layers_{i}"]
        for name in _ATTN_NAMES:
            put(getattr(block, name), layer[name])
        for name in _moe_names(cfg):
            put(getattr(block.moe, name), layer["moe"][name])
    put(model.final_norm, params["final_norm"])
    if model.lm_head is not None:
        put(model.lm_head, params["lm_head"])
    return model

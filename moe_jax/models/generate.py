"""Greedy generation with a KV cache, fixed shapes and one compilation.

:func:`generate` runs the whole loop as one jitted program: a prefill of the
left-padded prompt batch (``[B, Lp]`` tokens at cache slots ``0..Lp-1``),
then ``lax.scan`` over the decode steps (one token per sequence per step, at
slot ``Lp + s``). Nothing in the loop depends on values known only at run
time, so a configuration (model, batch shape, number of new tokens) compiles
once, whatever the prompts.

With ``record_traces=True`` it also returns the routing of every MoE layer
at every step (the prefill is step 0, decode step ``s`` is step ``s + 1``)
as :class:`moe_jax.traces.RoutingTrace` records, ready for
:func:`moe_jax.traces.save_jsonl` and :func:`moe_jax.calibrate`. Token ids
in the traces are ``b * max_len + slot`` (sequence ``b``, cache slot), so a
token keeps its id across the layers of a step; the tokens of a step are
split over the ranks in the layer's own order (contiguous shards).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_jax.dispatch import DispatchStats
from moe_jax.models.decoder import (DecoderConfig, MixtralLinen, MixtralNnx, ModelOutput,
                                    init_cache, linen_stats)
from moe_jax.models.sharding import shard_params
from moe_jax.traces import RoutingTrace

__all__ = ["GenerateResult", "generate", "pad_prompts", "routing_traces"]


class GenerateResult(NamedTuple):
    """tokens: [B, max_new_tokens] int32 (numpy); stats: DispatchStats summed
    over every layer and step (numpy ints); traces: list of RoutingTrace
    (by step, then layer) or None."""

    tokens: np.ndarray
    stats: DispatchStats
    traces: list[RoutingTrace] | None = None


def pad_prompts(prompts: Sequence[Sequence[int]], length: int | None = None,
                pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads prompts to a common length: (tokens [B, Lp] int32, mask [B, Lp] bool)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: need at least one prompt, each with at least one token")
    longest = max(len(p) for p in prompts)
    length = longest if length is None else length
    if length < longest:
        raise ValueError(f"length: {length} is shorter than the longest prompt ({longest})")
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), bool)
    for b, p in enumerate(prompts):
        tokens[b, length - len(p):] = np.asarray(p, np.int32)
        mask[b, length - len(p):] = True
    return tokens, mask


class _LinenApply:
    """Hashable apply function of a linen model (so compilations are reused)."""

    def __init__(self, model: MixtralLinen):
        self.model = model
        self.key = (model.cfg, model.mesh)

    def __call__(self, params, *args):
        out, mutated = self.model.apply({"params": params}, *args, mutable=["moe_stats"])
        return out._replace(stats=linen_stats(mutated, self.model.cfg))

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _LinenApply) and other.key == self.key


class _NnxApply:
    """Hashable apply function of an nnx graphdef (so compilations are reused)."""

    def __init__(self, graphdef):
        self.graphdef = graphdef

    def __call__(self, state, *args):
        return nnx.merge(self.graphdef, state)(*args)

    def __hash__(self):
        return hash(self.graphdef)

    def __eq__(self, other):
        return isinstance(other, _NnxApply) and other.graphdef == self.graphdef


@functools.lru_cache(maxsize=64)
def _compiled(apply, cfg: DecoderConfig, max_new_tokens: int, record: bool,
              on_step: Callable[[int], None] | None):

    def run(params, tokens, mask):
        batch, prompt_len = tokens.shape
        mask = mask.astype(bool)
        kv_valid = jnp.concatenate(
            [mask, jnp.ones((batch, cfg.max_len - prompt_len), bool)], axis=1)
        positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
        prompt_lens = jnp.sum(mask.astype(jnp.int32), axis=1)
        out: ModelOutput = apply(params, tokens, positions, init_cache(cfg, batch),
                                 jnp.int32(0), kv_valid, record)
        first = jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32)

        # The params ride in the carry: nnx modules merged from values closed
        # over from an outer trace refuse to update their variables.
        def step(carry, s):
            params, cache, token, stats = carry
            o = apply(params, token[:, None], (prompt_lens + s)[:, None], cache,
                      prompt_len + s, kv_valid, record)
            nxt = jnp.argmax(o.logits[:, 0], axis=-1).astype(jnp.int32)
            if on_step is not None:
                jax.debug.callback(on_step, s + 1)
            return (params, o.cache, nxt, stats + o.stats), (nxt, o.expert_ids, o.gating)

        (_, _, _, stats), (rest, eids, gating) = jax.lax.scan(
            step, (params, out.cache, first, out.stats),
            jnp.arange(max_new_tokens - 1, dtype=jnp.int32))
        generated = jnp.concatenate([first[:, None], rest.T], axis=1)
        routing = (out.expert_ids, out.gating, eids, gating) if record else None
        return generated, stats, routing

    return jax.jit(run)


def routing_traces(routing, batch: int, prompt_len: int, cfg: DecoderConfig,
                   num_ranks: int) -> list[RoutingTrace]:
    """RoutingTrace records from the arrays `generate` records (see module doc)."""
    pre_ids, pre_w, dec_ids, dec_w = (np.asarray(a) for a in routing)
    slots = np.arange(prompt_len)
    base = np.arange(batch, dtype=np.int64)[:, None] * cfg.max_len
    traces = []
    pre_tok = (base + slots[None, :]).reshape(-1)
    for layer in range(cfg.num_layers):
        traces.append(RoutingTrace(layer, pre_ids[layer], pre_w[layer], pre_tok,
                                   num_ranks=num_ranks, num_experts=cfg.moe.num_experts, step=0))
    for s in range(dec_ids.shape[0]):
        tok = base[:, 0] + prompt_len + s
        for layer in range(cfg.num_layers):
            traces.append(RoutingTrace(layer, dec_ids[s, layer], dec_w[s, layer], tok,
                                       num_ranks=num_ranks, num_experts=cfg.moe.num_experts,
                                       step=s + 1))
    return traces


def generate(model: MixtralLinen | MixtralNnx, params: Any, prompt_tokens, prompt_mask=None,
             *, max_new_tokens: int, mesh: jax.sharding.Mesh | None = None,
             record_traces: bool = False, trace_ranks: int | None = None,
             on_step: Callable[[int], None] | None = None) -> GenerateResult:
    """Greedy decoding of `max_new_tokens` tokens for a left-padded prompt batch.

    Args:
      model: MixtralLinen (params: its canonical params) or MixtralNnx
        (params: None, the model's own state is used).
      params: see `model`.
      prompt_tokens: [B, Lp] int, left-padded (see :func:`pad_prompts`).
      prompt_mask: [B, Lp] bool, False on padding (default: no padding).
      max_new_tokens: tokens to generate per sequence (Lp + max_new_tokens
        <= cfg.max_len).
      mesh: the expert-parallel mesh (default: the model's); parameters and
        prompts are placed on it, expert weights split over the expert axis.
        B must divide by the size of that axis (the MoE layer splits each
        step's tokens evenly over it).
      record_traces: also return the routing of every layer and step.
      trace_ranks: num_ranks written into the traces (default: the expert
        axis size, 1 without a mesh).
      on_step: called on the host with the decode step number (1 ..
        max_new_tokens - 1) as each step finishes (progress reporting).
    Returns:
      GenerateResult.
    """
    cfg: DecoderConfig = model.cfg
    model_mesh = model.mesh
    mesh = model_mesh if mesh is None else mesh
    if model_mesh is not None and mesh is not model_mesh and mesh != model_mesh:
        raise ValueError("mesh: differs from the mesh the model was built with")
    tokens = np.asarray(prompt_tokens)
    if tokens.ndim != 2 or tokens.dtype.kind not in "iu":
        raise ValueError(f"prompt_tokens: must be a [B, Lp] integer array, got "
                         f"{tokens.dtype} {tokens.shape}")
    mask = np.ones(tokens.shape, bool) if prompt_mask is None else np.asarray(prompt_mask, bool)
    if mask.shape != tokens.shape:
        raise ValueError(f"prompt_mask: shape {mask.shape} differs from prompt_tokens "
                         f"{tokens.shape}")
    if not mask.any(axis=1).all():
        raise ValueError("prompt_mask: every prompt needs at least one real token")
    batch, prompt_len = tokens.shape
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be an integer >= 1, got {max_new_tokens!r}")
    if prompt_len + max_new_tokens > cfg.max_len:
        raise ValueError(f"max_new_tokens: prompt length {prompt_len} + {max_new_tokens} new "
                         f"tokens exceed max_len={cfg.max_len}")
    axis = cfg.moe.expert_axis
    ranks = mesh.shape[axis] if mesh is not None and axis in mesh.axis_names else 1
    if cfg.moe.strategy != "dense" and ranks > 1:
        cfg.moe.experts_per_rank(ranks)  # raises naming num_experts
    if batch % ranks:
        raise ValueError(f"prompt_tokens: batch {batch} does not split evenly over the "
                         f"{ranks} ranks of mesh axis {axis!r}")
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise ValueError(f"prompt_tokens: ids must lie in [0, {cfg.vocab_size})")

    if isinstance(model, MixtralLinen):
        apply = _LinenApply(model)
        params = nn.meta.unbox(params)
    elif isinstance(model, MixtralNnx):
        apply = _NnxApply(nnx.graphdef(model))
        if params is not None:
            raise ValueError("params: pass None for an nnx model (its own state is used)")
        params = nnx.state(model)
    else:
        raise ValueError(f"model: expected MixtralLinen or MixtralNnx, got "
                         f"{type(model).__name__}")
    params = shard_params(params, mesh, axis)
    tokens_j, mask_j = jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)
    if mesh is not None:
        replicated = NamedSharding(mesh, P())
        tokens_j, mask_j = jax.device_put((tokens_j, mask_j), replicated)
    run = _compiled(apply, cfg, int(max_new_tokens), bool(record_traces), on_step)
    generated, stats, routing = run(params, tokens_j, mask_j)
    traces = None
    if record_traces:
        traces = routing_traces(routing, batch, prompt_len, cfg,
                                ranks if trace_ranks is None else trace_ranks)
    return GenerateResult(np.asarray(generated), DispatchStats(*map(np.asarray, stats)),
                          traces)


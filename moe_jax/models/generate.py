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

from moe_jax.dispatch import DispatchStats
from moe_jax.layer import resolve_transport
from moe_jax.models.decoder import (DecoderConfig, MixtralLinen, MixtralNnx, ModelOutput,
                                    init_cache, linen_stats)
from moe_jax.models.sharding import replicate, shard_params, spans_processes, to_host
from moe_jax.traces import RoutingTrace

__all__ = ["GenerateResult", "PreparedGeneration", "check_multiprocess", "collect",
           "execute", "generate", "pad_prompts", "prepare_generation", "routing_traces"]


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

    def __init__(self, model: MixtralLinen, replicated: bool = False):
        self.model = model
        self.replicated = replicated
        self.key = (model.cfg, model.mesh, model.replica_choice, replicated)

    def __call__(self, params, *args):
        placements = None
        if self.replicated:   # params = {"params": ..., "placements": per layer}
            params, placements = params["params"], params["placements"]
        out, mutated = self.model.apply({"params": params}, *args, placements=placements,
                                        mutable=["moe_stats"])
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


# The host function that receives decode-step reports while a generation
# runs. The compiled loop calls _report_step, not the caller's function, so
# a fresh progress bar per call does not trigger a recompilation.
_ON_STEP: list[Callable[[int], None] | None] = [None]


def _report_step(step) -> None:
    on_step = _ON_STEP[0]
    if on_step is not None:
        on_step(int(step))


@functools.lru_cache(maxsize=64)
def _compiled(apply, cfg: DecoderConfig, max_new_tokens: int, record: bool, report: bool):

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
            if report:
                jax.debug.callback(_report_step, s + 1)
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


class PreparedGeneration(NamedTuple):
    """A generation ready to run: ``run(*args)`` executes it on the device.

    run: the jitted program (params, tokens [B, Lp], mask [B, Lp]) ->
      (generated [B, T] int32, stats, routing or None); it also has
      ``.lower(*args)`` for ahead-of-time compilation.
    args: (params, tokens, mask), placed on the mesh.
    cfg: the model's DecoderConfig; batch B, prompt_len Lp, max_new_tokens T.
    trace_ranks: num_ranks written into recorded traces.
    on_step: receives the decode-step reports during :func:`execute`.
    """

    run: Callable
    args: tuple
    cfg: DecoderConfig
    batch: int
    prompt_len: int
    max_new_tokens: int
    record_traces: bool
    trace_ranks: int
    on_step: Callable[[int], None] | None = None


def check_multiprocess(cfg: DecoderConfig, mesh: jax.sharding.Mesh | None) -> None:
    """Raises ValueError for a MoE configuration that cannot run on `mesh`
    when the mesh spans several processes.

    On CPU, moe_jax's all-to-all custom call is a rendezvous of the devices
    of one process: ``transport="custom_call"`` cannot cross processes, nor
    can the ragged strategy's all-to-all unless ``kernel_impl="reference"``
    (XLA:CPU has no ``lax.ragged_all_to_all``; the reference builds it from
    an all-gather). On GPUs the custom-call transports cross processes (NCCL,
    or the NVLink channels mapped through CUDA IPC handles), but the ragged
    strategy's ``lax.ragged_all_to_all`` (its GPU path with transport "lax"
    or "custom_call") does not: XLA refuses the NCCL fallback it would need
    between processes.
    """
    if not spans_processes(mesh) or cfg.moe.strategy == "dense":
        return
    moe = cfg.moe
    transport = resolve_transport(moe, mesh).transport
    if mesh.devices.flat[0].platform != "cpu":
        if moe.strategy == "ragged" and transport != "nvlink":
            raise ValueError("transport: the ragged strategy moves rows with XLA's GPU "
                             "lax.ragged_all_to_all (transports 'lax' and 'custom_call'), "
                             "which cannot cross processes (XLA refuses its NCCL fallback); "
                             "use transport='nvlink' on a multi-process GPU mesh")
        return
    if transport == "custom_call":
        raise ValueError("transport: the CPU all-to-all custom call is an in-process "
                         "rendezvous and cannot cross processes; use transport='lax' on a "
                         "multi-process CPU mesh")
    if moe.strategy == "ragged" and moe.kernel_impl != "reference":
        raise ValueError("kernel_impl: on CPU the ragged strategy moves rows with the "
                         "in-process all-to-all custom call, which cannot cross processes; "
                         "use kernel_impl='reference' on a multi-process CPU mesh")


def prepare_generation(model: MixtralLinen | MixtralNnx, params: Any, prompt_tokens,
                       prompt_mask=None, *, max_new_tokens: int,
                       mesh: jax.sharding.Mesh | None = None, record_traces: bool = False,
                       trace_ranks: int | None = None,
                       on_step: Callable[[int], None] | None = None,
                       placements=None) -> PreparedGeneration:
    """Validates the arguments of :func:`generate`, places params and prompts
    on the mesh and returns the jitted program with its arguments (for
    timing it; :func:`collect` turns its outputs into a GenerateResult,
    :func:`execute` does both)."""
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
    token_axes = (*cfg.moe.data_axes, axis) if cfg.moe.strategy != "dense" else (axis,)
    split = [a for a in token_axes if mesh is not None and a in mesh.axis_names]
    token_ranks = int(np.prod([mesh.shape[a] for a in split])) if split else 1
    if batch % token_ranks:
        raise ValueError(f"prompt_tokens: batch {batch} does not split evenly over the "
                         f"{token_ranks} ranks of mesh axes {tuple(split)}")
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise ValueError(f"prompt_tokens: ids must lie in [0, {cfg.vocab_size})")
    check_multiprocess(cfg, mesh)

    if isinstance(model, MixtralLinen):
        apply = _LinenApply(model, placements is not None)
        params = nn.meta.unbox(params)
        if placements is not None:
            if len(placements) != cfg.num_layers:
                raise ValueError(f"placements: one per layer ({cfg.num_layers}), got "
                                 f"{len(placements)}")
            params = {"params": params,
                      "placements": tuple(p.device_arrays() for p in placements)}
    elif isinstance(model, MixtralNnx):
        apply = _NnxApply(nnx.graphdef(model))
        if params is not None:
            raise ValueError("params: pass None for an nnx model (its own state is used)")
        if placements is not None:
            raise ValueError("placements: an nnx model holds its own (MixtralNnx(..., "
                             "placements=))")
        params = nnx.state(model)
    else:
        raise ValueError(f"model: expected MixtralLinen or MixtralNnx, got "
                         f"{type(model).__name__}")
    params = shard_params(params, mesh, axis)
    inputs = (tokens.astype(np.int32), mask)
    inputs = replicate(inputs, mesh) if mesh is not None else tuple(map(jnp.asarray, inputs))
    run = _compiled(apply, cfg, int(max_new_tokens), bool(record_traces), on_step is not None)
    return PreparedGeneration(run, (params, *inputs), cfg, batch, prompt_len,
                              int(max_new_tokens), bool(record_traces),
                              ranks if trace_ranks is None else trace_ranks, on_step)


def collect(prepared: PreparedGeneration, outputs) -> GenerateResult:
    """The GenerateResult of one ``prepared.run(*prepared.args)`` (on every
    process when the mesh spans several: each gets the whole result)."""
    generated, stats, routing = outputs
    traces = None
    if prepared.record_traces:
        traces = routing_traces([to_host(a) for a in routing], prepared.batch,
                                prepared.prompt_len, prepared.cfg, prepared.trace_ranks)
    return GenerateResult(to_host(generated), DispatchStats(*map(to_host, stats)), traces)


def execute(prepared: PreparedGeneration) -> GenerateResult:
    """Runs a prepared generation (reporting steps to its on_step) and collects it."""
    previous, _ON_STEP[0] = _ON_STEP[0], prepared.on_step
    try:
        return collect(prepared, prepared.run(*prepared.args))
    finally:
        _ON_STEP[0] = previous


def generate(model: MixtralLinen | MixtralNnx, params: Any, prompt_tokens, prompt_mask=None,
             *, max_new_tokens: int, mesh: jax.sharding.Mesh | None = None,
             record_traces: bool = False, trace_ranks: int | None = None,
             on_step: Callable[[int], None] | None = None, placements=None) -> GenerateResult:
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
        step's tokens evenly over it). The mesh may span the devices of
        several processes (``jax.distributed``): every process then calls
        this with the same params and prompts, and each gets the result
        (see :func:`check_multiprocess` for what cannot cross processes).
      record_traces: also return the routing of every layer and step.
      trace_ranks: num_ranks written into the traces (default: the expert
        axis size, 1 without a mesh).
      on_step: called on the host with the decode step number (1 ..
        max_new_tokens - 1) as each step finishes (progress reporting).
      placements: MixtralLinen only: one moe_jax.replication.Placement per
        layer (hot-expert replication; params then hold slot weights, see
        moe_jax.models.decoder.replicate_params). Jitted inputs: another
        placement does not recompile.
    Returns:
      GenerateResult.
    """
    prepared = prepare_generation(model, params, prompt_tokens, prompt_mask,
                                  max_new_tokens=max_new_tokens, mesh=mesh,
                                  record_traces=record_traces, trace_ranks=trace_ranks,
                                  on_step=on_step, placements=placements)
    return execute(prepared)

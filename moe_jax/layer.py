"""The MoE layer as a function: router + dispatch strategy + SwiGLU experts."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_jax.config import MoEConfig
from moe_jax.dispatch import Delivered, DispatchContext, DispatchStats, dispatch_combine
from moe_jax.experts import ExpertWeights, init_expert_weights, swiglu_grouped
from moe_jax.ordered_grads import replicate_for_ranks
from moe_jax.plan import kept_picks
from moe_jax.replicated import (balanced_slot_ids, check_placement, dense_slot_ids, slot_ids,
                                tie_copies)
from moe_jax.replication import PlacementArrays
from moe_jax.routing import load_balancing_loss, route, router_logits, router_z_loss
from moe_jax.topology import (TransportChoice, choose_transport, fast_topology, logger,
                              peer_link)


class MoEParams(NamedTuple):
    """router: [H, E]; router_bias: [E] selection bias (sigmoid router) or
    None; experts: stacked [E, ...] SwiGLU weights (sharded over the expert
    axis under expert parallelism), or with a placement (hot-expert
    replication) [P * S, ...] weights, one per physical slot
    (`moe_jax.replicated.slot_weights`)."""

    router: jax.Array
    router_bias: jax.Array | None
    experts: ExpertWeights


class MoEAux(NamedTuple):
    """load_balance_loss, router_z_loss: float32 scalars (unweighted);
    stats: DispatchStats; delivered: rows each expert (or, with a placement,
    each slot) received (debug); expert_rows: [E] int32 rows routed to each
    logical expert, every rank and data group together (what
    `moe_jax.replication.LoadTracker.update` reads)."""

    load_balance_loss: jax.Array
    router_z_loss: jax.Array
    stats: DispatchStats
    delivered: Delivered | None = None
    expert_rows: jax.Array | None = None

    def weighted_loss(self, config: MoEConfig) -> jax.Array:
        return (config.load_balance_coef * self.load_balance_loss
                + config.router_z_coef * self.router_z_loss)


def init_moe_params(key: jax.Array, config: MoEConfig) -> MoEParams:
    """Random parameters in config.param_dtype (unsharded)."""
    k_router, k_experts = jax.random.split(key)
    hidden, num_experts = config.hidden_size, config.num_experts
    router = (jax.random.normal(k_router, (hidden, num_experts)) * hidden ** -0.5)
    bias = jnp.zeros((num_experts,), config.param_dtype) \
        if config.router == "sigmoid_grouped" else None
    experts = init_expert_weights(k_experts, num_experts, hidden, config.ffn_size,
                                  config.param_dtype)
    return MoEParams(router.astype(config.param_dtype), bias, experts)


def _platform(mesh) -> str:
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    return "cpu" if platform == "cpu" else "gpu"


def resolve_transport(config: MoEConfig, mesh=None) -> TransportChoice:
    """The transport `moe_layer` runs for `config` on `mesh`, and why.

    For `transport="auto"` the choice of `moe_jax.topology.choose_transport`
    over the mesh's devices; any other transport is returned as given (with
    the reason "configured"). Runs on the host, outside jit.
    """
    if config.transport != "auto":
        return TransportChoice(config.transport, "configured")
    if config.strategy == "dense" or mesh is None:
        return choose_transport("dense", _platform(mesh), ())
    return choose_transport(config.strategy, _platform(mesh), tuple(mesh.devices.flat))


def _transport(config: MoEConfig, mesh) -> str:
    choice = resolve_transport(config, mesh)
    if config.transport == "auto":
        logger.info("moe_jax: transport='auto' runs %r: %s", choice.transport, choice.reason)
    elif config.transport == "nvlink" and mesh is not None and _platform(mesh) == "gpu" \
            and peer_link(mesh.devices.flat) == "pcie":
        logger.warning("moe_jax: transport='nvlink' over GPUs that are peers over PCIe "
                       "only; expect all-to-all far below NVLink speed")
    return choice.transport


def _place(a: jax.Array, mesh, spec) -> jax.Array:
    """Lays `a` out as `spec` over `mesh`, whatever the mesh's axis types."""
    if _is_explicit(mesh):
        return jax.sharding.reshard(a, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))


def _is_explicit(mesh) -> bool:
    return mesh is not None and any(t == jax.sharding.AxisType.Explicit
                                    for t in mesh.axis_types)


def _flatten(x: jax.Array, mesh, token_spec: P) -> jax.Array:
    """[..., H] -> [tokens, H], split as token_spec on explicit meshes."""
    shape = (-1, x.shape[-1])
    if _is_explicit(mesh) and x.ndim != 2:
        return jax.lax.reshape(x, (x.size // x.shape[-1], x.shape[-1]),
                               out_sharding=NamedSharding(mesh, token_spec))
    return x.reshape(shape)


def _unflatten(out: jax.Array, like: jax.Array, mesh=None, token_spec: P = P(),
               token_ranks: int = 1):
    """[tokens, H] -> the shape of `like`, keeping an explicit mesh's types valid."""
    if out.shape == like.shape:
        return out
    if not _is_explicit(mesh):
        return out.reshape(like.shape)
    spec = getattr(getattr(jax.typeof(like), "sharding", None), "spec", None)
    if spec is None or getattr(jax.typeof(like).sharding.mesh, "empty", True):
        spec = token_spec if like.shape[0] % token_ranks == 0 else P()
    return jax.lax.reshape(out, like.shape, out_sharding=NamedSharding(mesh, spec))


class _Experts:
    """The layer's expert function (moe_jax.dispatch.passes.ExpertFn). With
    the row-invariant matmul it takes the rows' sources, so that its weight
    gradients are summed per (expert, source) in source order."""

    def __init__(self, experts: ExpertWeights, config: MoEConfig, platform: str):
        self.experts, self.config, self.platform = experts, config, platform
        self.takes_sources = config.matmul == "row_invariant"

    def __call__(self, rows, group_sizes, sources=None):
        return swiglu_grouped(rows, group_sizes, self.experts, self.config.dtype,
                              self.config.matmul, self.platform, sources=sources)


def _route_and_dispatch(params: MoEParams, tokens: jax.Array, config: MoEConfig,
                        ctx: DispatchContext, return_delivered: bool,
                        placement: PlacementArrays | None = None,
                        replica_choice: str = "local"):
    experts = params.experts
    if placement is not None:   # tied before routing: its gradient ends the backward
        if ctx.axis_name is None:
            local = placement.slot_expert.reshape(-1)
            experts, tokens = tie_copies(experts, tokens, placement, local)
        else:
            local = placement.slot_expert[ctx.rank()]
            experts, tokens = tie_copies(experts, tokens, placement, local,
                                         lambda t: jax.lax.psum(t, ctx.axis_name))
    routing = route(router_logits(tokens, params.router, config), config, params.router_bias)
    ids = routing.expert_ids
    if placement is not None:
        if ctx.axis_name is None:
            ids = dense_slot_ids(ids, placement)
        elif replica_choice == "balanced":
            ids = balanced_slot_ids(ids, placement, ctx.rank(), ctx.all_gather)
        else:
            rank = ctx.rank()
            ids = slot_ids(ids, placement, rank, rank * tokens.shape[0])
    result = dispatch_combine(
        tokens.astype(config.dtype), ids, routing.weights,
        _Experts(experts, config, ctx.platform), strategy=config.strategy, ctx=ctx,
        experts_per_rank=experts.num_experts, capacity=config.capacity,
        spill_capacity=config.spill_capacity, return_delivered=return_delivered)
    psum = ctx.psum_tokens if ctx.token_axes else None
    stats = result.stats
    if ctx.data_axes:  # each group's counters (equal on its ranks), counted once
        first = ctx.rank() == 0
        once = lambda tree: jax.tree.map(lambda v: jnp.where(first, v, 0), tree)  # noqa: E731
        stats = stats.over_groups(lambda t: ctx.psum_tokens(once(t)), ctx.pmax_tokens)
    kept = kept_picks(routing.expert_ids, config.num_experts)
    expert_rows = jnp.zeros((config.num_experts,), jnp.int32).at[
        jnp.where(kept, routing.expert_ids, config.num_experts)].add(1, mode="drop")
    if psum is not None:
        expert_rows = psum(expert_rows)
    aux = MoEAux(load_balancing_loss(routing, config.num_experts, psum),
                 router_z_loss(routing, psum), stats, result.delivered, expert_rows)
    return result.out, aux


def moe_layer(params: MoEParams, x: jax.Array, config: MoEConfig,
              mesh: jax.sharding.Mesh | None = None, *,
              placement: PlacementArrays | None = None, replica_choice: str = "local",
              return_delivered: bool = False) -> tuple[jax.Array, MoEAux]:
    """Applies the MoE layer to x.

    Args:
      params: MoEParams with E experts.
      x: [..., H] activations; the flattened tokens are split evenly over the
        ranks of `config.data_axes` + (`config.expert_axis`,), in that order
        (their count must divide by the product of those axes' sizes).
      config: MoEConfig.
      mesh: mesh holding `config.expert_axis` and `config.data_axes`. For
        "dense" optional: with the expert axis the tokens are split over it
        (and the data axes) and every rank runs every expert on its own
        tokens; without it (or with a placement) the layer runs on the
        whole batch.
      placement: hot-expert replication (`moe_jax.replication`): the
        `Placement.device_arrays()` of E experts on P x S slots, P the size
        of the expert axis (any P for "dense"); params.experts then holds
        P * S slots' weights. A jitted argument: a new placement of the same
        shapes does not recompile. Each pick goes to a slot holding its
        expert (the replica on its own rank, else one by a hash of the
        token's index); the copies' gradients are summed (`tie_copies`).
        None: params.experts holds the E experts.
      replica_choice: with a placement, how a pick picks a replica: "local"
        (the sender's own replica, else a hash of the token's index) or
        "balanced" (the step's per-expert counts, all-gathered over the
        expert axis, level the holders' rows: `balanced_slot_ids`).
      return_delivered: return the rows each expert received in
        aux.delivered, every rank's split over the same axes as the tokens.
    Returns:
      (y [..., H] in config.dtype, MoEAux). The losses and stats cover every
      token of the call, all data-parallel groups together. Jit-compatible:
      static shapes, no host synchronization; graph-capturable when its
      custom calls are. With matmul="row_invariant" x and the results pass
      an optimization barrier (no XLA fusion across the layer's boundary)
      and every gradient is summed in one order on every strategy
      (moe_jax.ordered_grads).
    """
    if config.matmul == "row_invariant":
        x = jax.lax.optimization_barrier(x)
        y, aux = _moe_layer(params, x, config, mesh, placement, replica_choice,
                            return_delivered)
        return jax.lax.optimization_barrier((y, aux))
    return _moe_layer(params, x, config, mesh, placement, replica_choice, return_delivered)


def _moe_layer(params, x, config, mesh, placement, replica_choice, return_delivered):
    if x.shape[-1] != config.hidden_size:
        raise ValueError(f"moe_layer: argument 'x' must end in hidden_size="
                         f"{config.hidden_size}, got shape {list(x.shape)}")
    if params.router.shape != (config.hidden_size, config.num_experts):
        raise ValueError(f"moe_layer: argument 'params.router' must be "
                         f"[{config.hidden_size}, {config.num_experts}], "
                         f"got {list(params.router.shape)}")
    if placement is None and params.experts.num_experts != config.num_experts:
        raise ValueError(f"moe_layer: argument 'params.experts' must hold num_experts="
                         f"{config.num_experts} experts without a placement, got "
                         f"{params.experts.num_experts}")
    if replica_choice not in ("local", "balanced"):
        raise ValueError(f"moe_layer: argument 'replica_choice' must be 'local' or 'balanced', "
                         f"got {replica_choice!r}")
    if placement is not None:
        ranks = None if config.strategy == "dense" else (
            mesh.shape.get(config.expert_axis) if mesh is not None else None)
        check_placement(placement, config.num_experts, ranks, params.experts.num_experts,
                        "moe_layer")
    if config.strategy == "dense" and placement is None and mesh is not None \
            and config.expert_axis in mesh.axis_names:
        return _dense_data_parallel(params, x, config, mesh, return_delivered)
    if config.strategy == "dense":
        tokens = _flatten(x, mesh, P())
        ctx = DispatchContext(None, 1, _transport(config, None), config.kernel_impl,
                              _platform(mesh))
        out, aux = _route_and_dispatch(params, tokens, config, ctx, return_delivered,
                                       placement)
        return _unflatten(out, x, mesh), aux
    axis = config.expert_axis
    if mesh is None or axis not in mesh.axis_names:
        raise ValueError(f"moe_layer: argument 'mesh' must have the expert axis {axis!r} "
                         f"for strategy {config.strategy!r}, got "
                         f"{None if mesh is None else mesh.axis_names}")
    num_ranks = mesh.shape[axis]
    config.experts_per_rank(num_ranks)
    token_axes, token_spec, token_ranks = _token_axes(config, mesh)
    data_ranks = token_ranks // num_ranks
    tokens = _split_tokens(x, mesh, token_axes, token_spec, token_ranks)
    transport = _transport(config, mesh)
    ctx = DispatchContext(axis, num_ranks, transport, config.kernel_impl,
                          _platform(mesh), tuple(mesh.devices.flat),
                          dispatch_fp8=config.dispatch_fp8, data_axes=config.data_axes,
                          data_ranks=data_ranks,
                          fast_topology=fast_topology(config.fast_topology, mesh, axis)
                          if transport == "fast" else None)
    expert_spec = ExpertWeights(P(axis), P(axis))
    param_specs = MoEParams(P(), None if params.router_bias is None else P(), expert_spec)
    aux_spec = _aux_spec(token_spec, return_delivered)
    placement_spec = None if placement is None else PlacementArrays(P(), P(), P(), P())

    def body(p, t, placed):
        return _route_and_dispatch(p, t, config, ctx, return_delivered, placed, replica_choice)

    shard = lambda spec, a: _place(a, mesh, spec)
    params = jax.tree.map(shard, param_specs, params)
    tokens = shard(token_spec, tokens)
    if placement is not None:
        placement = PlacementArrays(*(shard(P(), jnp.asarray(a, jnp.int32))
                                      for a in placement))
    out, aux = jax.shard_map(body, mesh=mesh, in_specs=(param_specs, token_spec, placement_spec),
                             out_specs=(token_spec, aux_spec))(params, tokens, placement)
    return _unflatten(out, x, mesh, token_spec, num_ranks * data_ranks), aux


def _token_axes(config: MoEConfig, mesh) -> tuple[tuple[str, ...], P, int]:
    """(axes the tokens are split over, their spec, how many ranks)."""
    missing = [a for a in config.data_axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"moe_layer: argument 'mesh' lacks the data axes {missing} of "
                         f"MoEConfig.data_axes={config.data_axes}; its axes are "
                         f"{mesh.axis_names}")
    axes = (*config.data_axes, config.expert_axis)
    spec = P(axes) if config.data_axes else P(config.expert_axis)
    return axes, spec, math.prod(mesh.shape[a] for a in axes)


def _aux_spec(token_spec: P, return_delivered: bool) -> MoEAux:
    """MoEAux's shard_map out_specs: totals replicated, delivered rows split
    as the tokens."""
    delivered = Delivered(token_spec, token_spec, token_spec) if return_delivered else None
    return MoEAux(P(), P(), DispatchStats(*(P(),) * len(DispatchStats._fields)), delivered,
                  P())


def _split_tokens(x, mesh, axes, token_spec: P, ranks: int) -> jax.Array:
    """x flattened to [tokens, H], checked to split evenly over the ranks."""
    tokens = _flatten(x, mesh, token_spec)
    if tokens.shape[0] % ranks:
        raise ValueError(f"moe_layer: argument 'x' has {tokens.shape[0]} tokens, which do not "
                         f"split evenly over the {ranks} ranks of mesh axes {axes}")
    return tokens


def _dense_data_parallel(params: MoEParams, x: jax.Array, config: MoEConfig, mesh,
                         return_delivered: bool):
    """"dense" over a mesh: the tokens split over the expert (and data) axes
    as for the other strategies, every rank running every expert on its own
    tokens. The router's and experts' weight gradients are summed over the
    ranks; with the row-invariant matmul the experts' as per-rank float32
    partials added in rank order (ordered_grads), which is how the
    expert-parallel strategies add theirs, so they have the same bits."""
    axes, token_spec, ranks = _token_axes(config, mesh)
    tokens = _split_tokens(x, mesh, axes, token_spec, ranks)
    ctx = DispatchContext(None, 1, _transport(config, None), config.kernel_impl,
                          _platform(mesh), data_axes=axes, data_ranks=ranks)
    experts = params.experts
    if config.matmul == "row_invariant":
        experts = ExpertWeights(*(replicate_for_ranks(w.astype(jnp.float32), ranks)
                                  for w in experts))
        expert_spec = ExpertWeights(token_spec, token_spec)
    else:
        expert_spec = ExpertWeights(P(), P())
    param_specs = MoEParams(P(), None if params.router_bias is None else P(), expert_spec)
    aux_spec = _aux_spec(token_spec, return_delivered)

    def body(p, t):
        return _route_and_dispatch(p, t, config, ctx, return_delivered)

    params = jax.tree.map(lambda spec, a: _place(a, mesh, spec), param_specs,
                          MoEParams(params.router, params.router_bias, experts))
    tokens = _place(tokens, mesh, token_spec)
    out, aux = jax.shard_map(body, mesh=mesh, in_specs=(param_specs, token_spec),
                             out_specs=(token_spec, aux_spec))(params, tokens)
    return _unflatten(out, x, mesh, token_spec, ranks), aux

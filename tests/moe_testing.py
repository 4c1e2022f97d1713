"""Shared test helpers: random routings (adversarial ones too) and runners."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_jax as mj
from moe_jax.dispatch import DispatchContext, dispatch_combine

ROUTINGS = ("random", "one_expert", "empty_rank", "one_rank", "zipf")

# The expert matmuls the gradient tests run with (both differentiable).
GRAD_MATMULS = ("xla", "row_invariant")


def make_routing(rng: np.random.Generator, tokens: int, num_experts: int, top_k: int,
                 kind: str, experts_per_rank: int) -> np.ndarray:
    """[tokens, top_k] int32 distinct experts per token, of the given kind.

    random: uniform; one_expert: every token picks expert 0 first;
    empty_rank: nobody picks the last rank's experts; one_rank: every pick
    lands on rank 0 when it can; zipf: popularity ~ 1/rank^1.2.
    """
    if kind == "random":
        scores = rng.random((tokens, num_experts))
    elif kind == "one_expert":
        scores = rng.random((tokens, num_experts))
        scores[:, 0] = 2.0
    elif kind == "empty_rank":
        scores = rng.random((tokens, num_experts))
        if num_experts - experts_per_rank >= top_k:
            scores[:, num_experts - experts_per_rank:] = -1.0
    elif kind == "one_rank":
        scores = rng.random((tokens, num_experts))
        scores[:, :experts_per_rank] += 2.0
    elif kind == "zipf":
        popularity = 1.0 / np.arange(1, num_experts + 1) ** 1.2
        scores = np.log(rng.random((tokens, num_experts))) / popularity[rng.permutation(num_experts)]
    else:
        raise ValueError(kind)
    return np.argsort(-scores, axis=1, kind="stable")[:, :top_k].astype(np.int32)


def random_case(seed: int, ranks: int, tokens_per_rank: int, num_experts: int, top_k: int,
                hidden: int, kind: str, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    total = ranks * tokens_per_rank
    x = rng.standard_normal((total, hidden)).astype(np.float32)
    ids = make_routing(rng, total, num_experts, top_k, kind, num_experts // ranks)
    w = rng.random((total, top_k)).astype(np.float32) + 0.05
    w /= w.sum(axis=1, keepdims=True)
    return jnp.asarray(x, dtype), jnp.asarray(ids), jnp.asarray(w)


def expert_fn(weights: mj.ExpertWeights, dtype=jnp.float32, matmul: str = "xla"):
    """SwiGLU experts; matmul="row_invariant" makes every output row's bits
    independent of the other rows (then every strategy's output is dense's)."""
    return lambda rows, sizes: mj.swiglu_grouped(rows, sizes, weights, dtype, matmul)


def needs_gpus(count: int) -> None:
    """Skips the calling test unless this host has `count` GPUs."""
    import pytest  # noqa: PLC0415 (only tests call this)
    try:
        found = len(jax.devices("gpu"))
    except RuntimeError:
        found = 0
    if found < count:
        pytest.skip(f"needs {count} GPUs, found {found}")


def mesh_of(ranks: int, backend: str = "cpu", data: int = 1) -> jax.sharding.Mesh:
    """A 1-D mesh "ep" over the first `ranks` devices of `backend`; with
    data > 1 a ("data", "ep") mesh of data * ranks devices."""
    return mj.expert_mesh(ranks, data, jax.devices(backend))


@functools.lru_cache(maxsize=None)
def _strategy_runner(strategy, ranks, experts_per_rank, capacity, spill, impl, transport,
                     compute_dtype, backend, data, matmul):
    mesh = mesh_of(ranks, backend, data)
    data_axes = ("data",) if data > 1 else ()
    ctx = DispatchContext("ep", ranks, transport, impl, "cpu" if backend == "cpu" else "gpu",
                          tuple(mesh.devices.flat), data_axes=data_axes, data_ranks=data)

    def body(x, ids, w, w_gate_up, w_down):
        experts = expert_fn(mj.ExpertWeights(w_gate_up, w_down), compute_dtype, matmul)
        res = dispatch_combine(x, ids, w, experts,
                               strategy=strategy, ctx=ctx, experts_per_rank=experts_per_rank,
                               capacity=capacity, spill_capacity=spill, return_delivered=True)
        stats = jax.tree.map(lambda s: s[None], res.stats) if data > 1 else res.stats
        return res.out, res.delivered.rows, res.delivered.valid, stats

    spec = P(("data", "ep")) if data > 1 else P("ep")
    stats_spec = P("data") if data > 1 else P()
    experts_spec = P("ep")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3 + (experts_spec,) * 2,
                               out_specs=(spec, spec, spec,
                                          mj.DispatchStats(*(stats_spec,) * len(mj.DispatchStats._fields)))))
    return mesh, fn, spec


def run_strategy(strategy, x, ids, w, experts: mj.ExpertWeights, ranks, *, capacity=None,
                 spill=None, impl="custom_call", transport="lax", compute_dtype=jnp.float32,
                 backend="cpu", data=1, matmul="xla"):
    """Runs a strategy under shard_map over `ranks` CPU devices, or over
    `data` groups of `ranks` (a ("data", "ep") mesh: tokens split over both
    axes, data-major; experts over "ep").

    Returns (out [T, H], delivered rows [data * ranks, R, H], valid
    [data * ranks, R], stats: scalars, or [data] arrays (one per group)).
    """
    num_experts = experts.num_experts
    mesh, fn, spec = _strategy_runner(strategy, ranks, num_experts // ranks, capacity, spill,
                                      impl, transport, jnp.dtype(compute_dtype), backend, data,
                                      matmul)
    tokens = NamedSharding(mesh, spec)
    weights = NamedSharding(mesh, P("ep"))
    args = ([jax.device_put(a, tokens) for a in (x, ids, w)]
            + [jax.device_put(a, weights) for a in experts])
    out, rows, valid, stats = fn(*args)
    rows = np.asarray(rows).reshape((data * ranks, -1) + rows.shape[1:])
    return (np.asarray(out), rows, np.asarray(valid).reshape(data * ranks, -1),
            jax.device_get(stats))


@functools.lru_cache(maxsize=None)
def _dense_runner(num_experts, impl, compute_dtype, matmul):
    """The reference runs on CPU whatever the host has."""
    ctx = DispatchContext(None, 1, "lax", impl, "cpu")

    def run(x, ids, w, w_gate_up, w_down):
        experts = expert_fn(mj.ExpertWeights(w_gate_up, w_down), compute_dtype, matmul)
        res = dispatch_combine(x, ids, w, experts,
                               strategy="dense", ctx=ctx, experts_per_rank=num_experts,
                               return_delivered=True)
        return res.out, res.delivered.rows, res.delivered.group_sizes

    return jax.jit(run)


def run_dense(x, ids, w, experts: mj.ExpertWeights, *, impl="reference",
              compute_dtype=jnp.float32, matmul="xla"):
    """The reference: (out [T, H], rows [T*k, H] expert-major, group sizes [E])."""
    fn = _dense_runner(experts.num_experts, impl, jnp.dtype(compute_dtype), matmul)
    cpu = jax.devices("cpu")[0]
    out, rows, sizes = fn(*jax.device_put((x, ids, w, *experts), cpu))
    return np.asarray(out), np.asarray(rows), np.asarray(sizes)


def expected_rank_rows(dense_rows, dense_sizes, ranks):
    """Splits the dense expert-major rows into each rank's segment."""
    bounds = np.concatenate([[0], np.cumsum(dense_sizes)])
    per_rank = len(dense_sizes) // ranks
    return [dense_rows[bounds[r * per_rank]:bounds[(r + 1) * per_rank]] for r in range(ranks)]


def quantize_e4m3_np(x) -> tuple[np.ndarray, np.ndarray]:
    """NumPy reference of the fp8 dispatch format of x [N, H]: (e4m3 values
    as uint8 bits [N, H], float32 scales [N, H / 128]): per 128-element
    block, value = e4m3(x * (448 / amax)) rounded to nearest even and
    scale = amax * f32(1 / 448) (both factors 1 for an all-zero block)."""
    import ml_dtypes
    blocks = np.asarray(x, np.float32).reshape(x.shape[0], -1, 128)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(448) / amax, np.float32(1)).astype(np.float32)
    scales = np.where(amax > 0, amax * np.float32(1 / 448), np.float32(1)).astype(np.float32)
    values = (blocks * inverse[..., None]).astype(ml_dtypes.float8_e4m3fn)
    return values.reshape(x.shape).view(np.uint8), scales


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def rel_error(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def rowwise_experts(scales: jax.Array):
    """Expert e maps a row to tanh(row) * scales[e]: every output row (and
    its gradient) is a function of that row alone, bitwise. Padding rows
    (past sum(group_sizes)) may hold any bits, NaN included: they are read
    as zeros, so they touch neither the outputs nor the scales' gradient."""
    def fn(rows, group_sizes):
        expert = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes,
                            total_repeat_length=rows.shape[0])
        real = jnp.arange(rows.shape[0]) < jnp.sum(group_sizes)
        read = jnp.where(real[:, None], rows.astype(jnp.float32), 0.0)
        return (jnp.tanh(read) * scales[expert].astype(jnp.float32)).astype(rows.dtype)
    return fn


def _experts_of(kind: str, params, matmul: str):
    if kind == "rowwise":
        return rowwise_experts(params)
    return expert_fn(mj.ExpertWeights(*params), jnp.float32, matmul)


@functools.lru_cache(maxsize=None)
def _grad_runner(strategy, ranks, experts_per_rank, capacity, spill, impl, transport, kind,
                 matmul, backend):
    dense = strategy == "dense"
    mesh = None if dense else mesh_of(ranks, backend)
    platform = "cpu" if backend == "cpu" else "gpu"
    if dense:
        ctx = DispatchContext(None, 1, "lax", impl, platform)
    else:
        ctx = DispatchContext("ep", ranks, transport, impl, platform, tuple(mesh.devices.flat))

    def body(x, ids, w, params):
        res = dispatch_combine(x, ids, w, _experts_of(kind, params, matmul), strategy=strategy,
                               ctx=ctx, experts_per_rank=experts_per_rank, capacity=capacity,
                               spill_capacity=spill)
        return res.out, (res.stats.dropped_rows, res.stats.fallback_steps)

    if not dense:
        spec = P("ep")
        body = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4,
                             out_specs=(spec, (P(), P())))

    def loss(x, w, params, ids, ct):
        out, counts = body(x, ids, w, params)
        return jnp.sum(out.astype(jnp.float32) * ct), (out, counts)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def strategy_grads(strategy, x, ids, w, params, ranks, *, capacity=None, spill=None,
                   impl="custom_call", transport="lax", kind="rowwise", matmul="xla",
                   backend="cpu", seed=0):
    """Gradients of sum(out * ct) (ct random, fixed by seed) through
    dispatch_combine on `ranks` devices of `backend` ("dense": one rank).

    params: [E, H] scales (kind "rowwise", see rowwise_experts) or the three
    SwiGLU weights (kind "swiglu"). Returns (out [T, H], stats.dropped_rows,
    dx, dw, dparams, stats.fallback_steps) as numpy / ints.
    """
    num_experts = jax.tree.leaves(params)[0].shape[0]
    experts_per_rank = num_experts if strategy == "dense" else num_experts // ranks
    ct = jax.random.normal(jax.random.key(seed), x.shape, jnp.float32)
    fn = _grad_runner(strategy, ranks, experts_per_rank, capacity, spill, impl, transport,
                      kind, matmul, backend)
    (_, (out, (dropped, fallback))), (dx, dw, dparams) = fn(x, w, params, ids, ct)
    return (np.asarray(out), int(dropped), np.asarray(dx), np.asarray(dw),
            jax.tree.map(np.asarray, dparams), int(fallback))

"""Stacked SwiGLU experts and their grouped matmuls over received rows."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.ops import grouped_matmul as gmm
from moe_jax.ordered_grads import SourceSizes, ordered_sum, source_weight_grads, summed_to


class ExpertWeights(NamedTuple):
    """SwiGLU weights of G experts (all experts, or one rank's shard).

    w_gate_up: [G, H, 2F] the gate and up projections fused: columns
      alternate blocks of `moe_jax.ops.grouped_matmul.gate_up_block(F)` (8)
      gate columns and the up columns of the same indices (build it with
      `ExpertWeights.from_gate_up` or `moe_jax.ops.grouped_matmul.fuse_gate_up`).
    w_down: [G, F, H].
    """

    w_gate_up: jax.Array
    w_down: jax.Array

    @classmethod
    def from_gate_up(cls, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
                     ) -> "ExpertWeights":
        """From separate [G, H, F] gate and up weights."""
        return cls(gmm.fuse_gate_up(w_gate, w_up), w_down)

    @property
    def num_experts(self) -> int:
        return self.w_gate_up.shape[0]

    @property
    def ffn_size(self) -> int:
        return self.w_down.shape[1]

    def gate_up(self) -> tuple[jax.Array, jax.Array]:
        """The separate [G, H, F] gate and up weights."""
        return gmm.split_gate_up(self.w_gate_up)


def init_expert_weights(key: jax.Array, num_experts: int, hidden: int, ffn: int,
                        dtype=jnp.float32) -> ExpertWeights:
    """Scaled-normal initialization (fan-in), as a linear layer would."""
    kg, ku, kd = jax.random.split(key, 3)
    scale_in, scale_out = hidden ** -0.5, ffn ** -0.5
    return ExpertWeights.from_gate_up(
        (jax.random.normal(kg, (num_experts, hidden, ffn)) * scale_in).astype(dtype),
        (jax.random.normal(ku, (num_experts, hidden, ffn)) * scale_in).astype(dtype),
        (jax.random.normal(kd, (num_experts, ffn, hidden)) * scale_out).astype(dtype))


def swiglu_grouped(rows: jax.Array, group_sizes: jax.Array, weights: ExpertWeights,
                   compute_dtype=jnp.bfloat16, matmul: str = "auto",
                   platform: str | None = None,
                   sources: SourceSizes | None = None) -> jax.Array:
    """SwiGLU of each row with its expert's weights.

    Args:
      rows: [M, H] rows sorted by expert; rows past sum(group_sizes) are
        padding (their outputs are zero).
      group_sizes: [G] int32 rows of each expert, in order (on the device).
      weights: the G experts' weights.
      compute_dtype: dtype of the matmul inputs (float32 accumulation).
      matmul: "auto", "cutlass", "row_invariant" or "xla": the
        implementation of the grouped matmuls (see MoEConfig.matmul and
        moe_jax.ops.grouped_matmul). With "cutlass" (the default on Hopper
        GPUs for bfloat16/float16) the expert is two CUTLASS grouped GEMMs:
        gate/up with a fused SwiGLU epilogue, then down.
      platform: "cpu" or "gpu" (default: the default backend).
      sources: with matmul="row_invariant", the source rank of the rows
        (moe_jax.ordered_grads.SourceSizes): the weight gradients are then
        float32 partials per (expert, source), added in source order, so
        they do not depend on how the rows were split over ranks. Ignored
        otherwise.
    Returns:
      [M, H] in the dtype of rows. Differentiable.
    """
    if matmul == "row_invariant" and sources is not None:
        return _swiglu_ordered(rows, group_sizes, sources.sizes, weights.w_gate_up,
                               weights.w_down, jnp.dtype(compute_dtype), platform,
                               int(sources.max_rows))
    return _swiglu(rows, group_sizes, weights, compute_dtype, matmul, platform)


def _swiglu(rows, group_sizes, weights: ExpertWeights, compute_dtype, matmul, platform):
    compute_dtype = jnp.dtype(compute_dtype)
    x = rows.astype(compute_dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    hidden = gmm.swiglu(x, weights.w_gate_up.astype(compute_dtype), group_sizes,
                        impl=matmul, platform=platform)
    out = gmm.grouped_matmul(hidden, weights.w_down.astype(compute_dtype), group_sizes,
                             out_dtype=_out_dtype(rows, compute_dtype), impl=matmul,
                             platform=platform)
    return out.astype(rows.dtype)


def _out_dtype(rows, compute_dtype):
    return rows.dtype if jnp.dtype(rows.dtype) in (compute_dtype,
                                                   jnp.dtype(jnp.float32)) else jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _swiglu_ordered(rows, group_sizes, source_sizes, w_gate_up, w_down, compute_dtype,
                    platform, max_rows):
    return _swiglu(rows, group_sizes, ExpertWeights(w_gate_up, w_down), compute_dtype,
                   "row_invariant", platform)


def _swiglu_ordered_fwd(rows, group_sizes, source_sizes, w_gate_up, w_down, compute_dtype,
                        platform, max_rows):
    out = _swiglu_ordered(rows, group_sizes, source_sizes, w_gate_up, w_down, compute_dtype,
                          platform, max_rows)
    return out, (rows, group_sizes, source_sizes, w_gate_up, w_down)


def _swiglu_ordered_bwd(compute_dtype, platform, max_rows, residuals, dy):
    rows, group_sizes, source_sizes, w_gate_up, w_down = residuals
    gs = group_sizes.astype(jnp.int32)
    x = rows.astype(compute_dtype)
    w_gu, w_d = w_gate_up.astype(compute_dtype), w_down.astype(compute_dtype)

    def matmul(a, w):
        """Row-invariant a @ w[g] per group, float32; the input gradients too
        (a function of their own row), so every strategy gets their bits."""
        return gmm.grouped_matmul(a.astype(compute_dtype), w, gs, out_dtype=jnp.float32,
                                  impl="row_invariant", platform=platform)

    def activation(gate_up):
        gate, up = gmm.split_gate_up(gate_up)
        return (jax.nn.silu(gate) * up).astype(compute_dtype)

    hidden, pull_act = jax.vjp(activation, matmul(x, w_gu))
    d_hidden = matmul(dy, jnp.swapaxes(w_d, 1, 2)).astype(compute_dtype)
    (d_gate_up,) = pull_act(d_hidden)
    dx = matmul(d_gate_up, jnp.swapaxes(w_gu, 1, 2))
    sources = SourceSizes(source_sizes, max_rows)
    d_w_down = ordered_sum(source_weight_grads(hidden, dy, sources, platform), 1)
    d_w_gate_up = ordered_sum(source_weight_grads(x, d_gate_up, sources, platform), 1)
    return (dx.astype(rows.dtype), None, None,
            summed_to(d_w_gate_up, w_gate_up).astype(w_gate_up.dtype),
            summed_to(d_w_down, w_down).astype(w_down.dtype))


_swiglu_ordered.defvjp(_swiglu_ordered_fwd, _swiglu_ordered_bwd)

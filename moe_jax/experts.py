"""Stacked SwiGLU experts and their grouped matmul over received rows."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax import row_invariant


class ExpertWeights(NamedTuple):
    """SwiGLU weights of G experts (all experts, or one rank's shard).

    w_gate: [G, H, F]; w_up: [G, H, F]; w_down: [G, F, H].
    """

    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array

    @property
    def num_experts(self) -> int:
        return self.w_gate.shape[0]


def init_expert_weights(key: jax.Array, num_experts: int, hidden: int, ffn: int,
                        dtype=jnp.float32) -> ExpertWeights:
    """Scaled-normal initialization (fan-in), as a linear layer would."""
    kg, ku, kd = jax.random.split(key, 3)
    scale_in, scale_out = hidden ** -0.5, ffn ** -0.5
    return ExpertWeights(
        (jax.random.normal(kg, (num_experts, hidden, ffn)) * scale_in).astype(dtype),
        (jax.random.normal(ku, (num_experts, hidden, ffn)) * scale_in).astype(dtype),
        (jax.random.normal(kd, (num_experts, ffn, hidden)) * scale_out).astype(dtype))


def swiglu_grouped(rows: jax.Array, group_sizes: jax.Array, weights: ExpertWeights,
                   compute_dtype=jnp.bfloat16, matmul: str = "xla") -> jax.Array:
    """SwiGLU of each row with its expert's weights.

    Args:
      rows: [M, H] rows sorted by expert; rows past sum(group_sizes) are
        padding and their outputs are unspecified.
      group_sizes: [G] int32 rows of each expert, in order.
      weights: the G experts' weights.
      compute_dtype: dtype of the matmul inputs (float32 accumulation).
      matmul: "xla" (lax.ragged_dot) or "row_invariant" (each output row's
        bits independent of M and of the other rows; see MoEConfig.matmul).
    Returns:
      [M, H] in the dtype of rows.
    """
    x = rows.astype(compute_dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    dot = _grouped_dot(matmul)
    gate = dot(x, weights.w_gate.astype(compute_dtype), group_sizes)
    up = dot(x, weights.w_up.astype(compute_dtype), group_sizes)
    hidden = (jax.nn.silu(gate) * up).astype(compute_dtype)
    out = dot(hidden, weights.w_down.astype(compute_dtype), group_sizes)
    return out.astype(rows.dtype)


def _grouped_dot(matmul: str):
    """(x [M, K], w [G, K, N], group_sizes [G]) -> [M, N] float32."""
    if matmul == "row_invariant":
        return row_invariant.grouped_matmul
    if matmul != "xla":
        raise ValueError(f"swiglu_grouped: argument 'matmul' must be 'xla' or "
                         f"'row_invariant', got {matmul!r}")
    return lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes,
                                                  preferred_element_type=jnp.float32)

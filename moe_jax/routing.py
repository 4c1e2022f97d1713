"""Routers: pick top-k experts per token, with their combine weights.

Ties are broken towards the lower expert index (`lax.top_k` is stable), so
routing is deterministic for given logits. With `fixed_order` (the
layer sets it with `MoEConfig.matmul="row_invariant"`) the sums over a
token's experts (the softmax, the renormalization of the picks) and their
gradients' sums run in a fixed pairwise order (`transposes.row_dots`), so
their bits do not depend on how XLA fuses the program around them; those
functions have reverse-mode gradients only (`jax.grad`, `jax.vjp`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.ordered_grads import ordered_matmul
from moe_jax.transposes import row_dots


class Routing(NamedTuple):
    """Routing decision for T tokens.

    expert_ids: [T, k] int32 global expert ids, distinct per token.
    weights: [T, k] float32 combine weights.
    probs: [T, E] float32 router probabilities (softmax or sigmoid scores).
    logits: [T, E] float32 router logits.
    """

    expert_ids: jax.Array
    weights: jax.Array
    probs: jax.Array
    logits: jax.Array


def topk_softmax(logits: jax.Array, top_k: int, fixed_order: bool = False) -> Routing:
    """Mixtral routing: softmax over experts, top-k, weights renormalized.

    Args:
      logits: [T, E] router logits (any float dtype; computed in float32).
      top_k: experts per token.
      fixed_order: sum in a fixed order (`softmax`, `renormalize`; module doc).
    """
    logits = logits.astype(jnp.float32)
    probs = softmax(logits) if fixed_order else jax.nn.softmax(logits, axis=-1)
    top_probs, expert_ids = jax.lax.top_k(probs, top_k)
    weights = _renormalized(top_probs, fixed_order)
    return Routing(expert_ids.astype(jnp.int32), weights, probs, logits)


def sigmoid_grouped(logits: jax.Array, top_k: int, num_groups: int, topk_groups: int,
                    bias: jax.Array | None = None, routed_scaling: float = 1.0,
                    fixed_order: bool = False) -> Routing:
    """DeepSeek-V3 routing: sigmoid scores, group-limited top-k.

    Experts are split into `num_groups` contiguous groups; a group's score is
    the sum of its two best (biased) expert scores; only the best
    `topk_groups` groups are eligible. `bias` [E] shifts selection only; the
    weights are the unbiased scores of the picks, renormalized and scaled
    (`fixed_order`: as in topk_softmax).
    """
    logits = logits.astype(jnp.float32)
    num_tokens, num_experts = logits.shape
    scores = jax.nn.sigmoid(logits)
    select = scores if bias is None else scores + bias.astype(jnp.float32)
    per_group = num_experts // num_groups
    grouped = select.reshape(num_tokens, num_groups, per_group)
    best = jax.lax.top_k(grouped, min(2, per_group))[0]
    group_scores = jnp.sum(best, axis=-1)
    _, keep_groups = jax.lax.top_k(group_scores, topk_groups)
    group_mask = jnp.zeros((num_tokens, num_groups), bool)
    group_mask = group_mask.at[jnp.arange(num_tokens)[:, None], keep_groups].set(True)
    expert_mask = jnp.repeat(group_mask, per_group, axis=1)
    masked = jnp.where(expert_mask, select, -jnp.inf)
    _, expert_ids = jax.lax.top_k(masked, top_k)
    picked = jnp.take_along_axis(scores, expert_ids, axis=-1)
    weights = _renormalized(picked, fixed_order) * routed_scaling
    return Routing(expert_ids.astype(jnp.int32), weights, scores, logits)


def _renormalized(picked: jax.Array, fixed_order: bool) -> jax.Array:
    if fixed_order:
        return renormalize(picked)
    return picked / jnp.sum(picked, axis=-1, keepdims=True)


def _row_sum(v: jax.Array) -> jax.Array:
    """[...] fixed-order sums of the rows of v [..., N] float32."""
    return row_dots(v, jnp.ones_like(v))


@jax.custom_vjp
def softmax(logits: jax.Array) -> jax.Array:
    """Softmax over the last axis of [..., E] float32 logits, its sums (and its
    gradient's) in a fixed order. Reverse-mode differentiable."""
    e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    return e / _row_sum(e)[..., None]


def _softmax_fwd(logits):
    probs = softmax(logits)
    return probs, probs


def _softmax_bwd(probs, d_probs):
    return (probs * (d_probs - row_dots(d_probs, probs)[..., None]),)


softmax.defvjp(_softmax_fwd, _softmax_bwd)


@jax.custom_vjp
def renormalize(picked: jax.Array) -> jax.Array:
    """[..., k] float32 rows divided by their sums, in a fixed order (and the
    gradient's). Reverse-mode differentiable."""
    return picked / _row_sum(picked)[..., None]


def _renormalize_fwd(picked):
    total = _row_sum(picked)
    weights = picked / total[..., None]
    return weights, (weights, total)


def _renormalize_bwd(residuals, d_weights):
    weights, total = residuals
    return ((d_weights - row_dots(d_weights, weights)[..., None]) / total[..., None],)


renormalize.defvjp(_renormalize_fwd, _renormalize_bwd)


def load_balancing_loss(routing: Routing, num_experts: int,
                        psum: Callable | None = None) -> jax.Array:
    """Switch/Mixtral auxiliary loss E * sum_e f_e * p_e (1.0 when balanced).

    f_e is the fraction of (token, slot) picks that chose expert e and p_e the
    mean router probability of e, over all tokens of the group when `psum`
    (a sum over the group, e.g. DispatchContext.psum inside shard_map) is
    given, else over the T local tokens.
    """
    counts = jnp.zeros((num_experts,), jnp.float32).at[routing.expert_ids.reshape(-1)].add(1.0)
    prob_sum = jnp.sum(routing.probs, axis=0)
    num_tokens = jnp.float32(routing.probs.shape[0])
    if psum is not None:
        counts, prob_sum, num_tokens = psum((counts, prob_sum, num_tokens))
    frac = counts / (num_tokens * routing.expert_ids.shape[1])
    mean_prob = prob_sum / num_tokens
    return num_experts * jnp.sum(frac * mean_prob)


def router_z_loss(routing: Routing, psum: Callable | None = None) -> jax.Array:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2."""
    z = jax.nn.logsumexp(routing.logits, axis=-1)
    total = jnp.sum(z * z)
    count = jnp.float32(z.shape[0])
    if psum is not None:
        total, count = psum((total, count))
    return total / count


def router_logits(tokens: jax.Array, router: jax.Array, config) -> jax.Array:
    """Router logits [T, E] float32 of tokens [T, H] and router [H, E], in
    float32 with the multiply `config.matmul` names (see MoEConfig)."""
    x, w = tokens.astype(jnp.float32), router.astype(jnp.float32)
    if config.matmul == "row_invariant":
        return ordered_matmul(x, w)
    return jnp.dot(x, w)


def route(logits: jax.Array, config, bias: jax.Array | None = None) -> Routing:
    """Routes with the router `config.router` names (see MoEConfig); its sums
    in a fixed order with `config.matmul == "row_invariant"`."""
    fixed_order = config.matmul == "row_invariant"
    if config.router == "softmax":
        return topk_softmax(logits, config.top_k, fixed_order=fixed_order)
    return sigmoid_grouped(logits, config.top_k, config.num_groups, config.topk_groups,
                           bias=bias, routed_scaling=config.routed_scaling,
                           fixed_order=fixed_order)

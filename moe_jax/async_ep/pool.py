"""Token pool (merges the top-k copies of a token) and the receptor.

After attention of block b a token is split into a residual part (kept for
the merge) and k copies, one per routed expert. The pool of the device that
runs the next layer holds the parts of a token, identified by
(request_id, position, next layer), until the residual and all k expert
outputs arrived, then merges them with `combine_topk`:

  merged = residual + w_0 * out_0 + w_1 * out_1 + ... (float32, in k order)

so the result does not depend on the order the parts arrived in and equals a
synchronous combine that sums in the same order.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moe_jax.async_ep.queues import LayerQueues
from moe_jax.async_ep.tokens import EXPERT, LayerId, Token


def combine_topk(residual: np.ndarray, outputs: Sequence[np.ndarray],
                 weights: Sequence[float]) -> np.ndarray:
    """residual + sum_j weights[j] * outputs[j], float32, summed in j order.

    Args:
      residual: [..., H] residual stream.
      outputs: k arrays [..., H], the expert outputs in top-k slot order.
      weights: k weights (scalars, or arrays broadcasting against [..., 1]).
    Returns:
      float32 [..., H].
    """
    if len(outputs) != len(weights):
        raise ValueError(f"outputs: {len(outputs)} outputs for {len(weights)} weights")
    acc = np.asarray(residual, np.float32)
    for out, weight in zip(outputs, weights):
        acc = acc + np.asarray(weight, np.float32) * np.asarray(out, np.float32)
    return acc


class TokenPool:
    """Holds parts of tokens until all k+1 (residual + k outputs) arrived.

    Args:
      top_k: experts per token (k).
    """

    def __init__(self, top_k: int):
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.top_k = top_k
        self._parts: dict[tuple[int, int, LayerId], dict[int, Token]] = {}

    def add(self, token: Token) -> Token | None:
        """Adds one part; returns the merged whole token once complete."""
        if token.part is None or not -1 <= token.part < self.top_k:
            raise ValueError(f"token: part must be in [-1, {self.top_k}), got {token.part}")
        parts = self._parts.setdefault(token.key, {})
        if token.part in parts:
            raise ValueError(f"token: duplicate part {token.part} of {token.key}")
        parts[token.part] = token
        if len(parts) < self.top_k + 1:
            return None
        del self._parts[token.key]
        experts = [parts[j] for j in range(self.top_k)]
        merged = combine_topk(parts[-1].data, [p.data for p in experts],
                              [p.weight for p in experts])
        return Token(token.request_id, token.position, token.rank, token.layer, merged)

    def __len__(self) -> int:
        """Number of tokens with parts waiting."""
        return len(self._parts)


class Receptor:
    """Entry point of a device: tokens ready by themselves (including top-k copies
    bound for an expert layer) go to their queue, merge parts to the pool."""

    def __init__(self, queues: LayerQueues, pool: TokenPool):
        self.queues = queues
        self.pool = pool

    def receive(self, tokens: Sequence[Token]) -> int:
        """Enqueues what is ready; returns how many tokens became ready."""
        ready = 0
        for token in tokens:
            if token.part is not None and token.layer.kind != EXPERT:
                token = self.pool.add(token)
                if token is None:
                    continue
            self.queues.push(token)
            ready += 1
        return ready

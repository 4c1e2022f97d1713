"""Token metadata of the asynchronous executor.

A token is one request's hidden state at one position, on its way to one
layer. Layers are named by `LayerId`:

  (block, "attention", rank)  attention of `block` on attention DP rank `rank`
                              (its first operator is the top-k merge, its last
                              the router);
  (block, "expert", e)        the SwiGLU FFN of expert `e` in `block`;
  (num_blocks, "sampler", rank)  final norm, LM head and greedy sampling.

The data of a token lives on the host as a float32 numpy vector [H] (the
simulation's stand-in for a reference to a device tensor).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

ATTENTION = "attention"
EXPERT = "expert"
SAMPLER = "sampler"
KINDS = (ATTENTION, EXPERT, SAMPLER)


class LayerId(NamedTuple):
    """(block, kind, index): index is the attention rank or the expert id."""

    block: int
    kind: str
    index: int

    def order(self) -> int:
        """Position in the forward pass: attention of b, experts of b, then b+1."""
        if self.kind == ATTENTION:
            return 2 * self.block
        if self.kind == EXPERT:
            return 2 * self.block + 1
        return 2 * self.block  # sampler: block == num_blocks


def attention_layer(block: int, rank: int) -> LayerId:
    return LayerId(int(block), ATTENTION, int(rank))


def expert_layer(block: int, expert: int) -> LayerId:
    return LayerId(int(block), EXPERT, int(expert))


def sampler_layer(num_blocks: int, rank: int) -> LayerId:
    return LayerId(int(num_blocks), SAMPLER, int(rank))


@dataclasses.dataclass
class Token:
    """One token (or one top-k copy / part of one) in flight.

    request_id: the request it belongs to.
    position: its position in the request's sequence (int).
    rank: attention DP rank holding the request's KV cache.
    layer: the LayerId it is queued for.
    data: float32 [H] hidden vector (for attention: the residual stream; for
      an expert: its normalized input; for a part: residual or expert output).
    part: None for a whole token; -1 for the residual part of a token being
      merged; j in [0, k) for the output of its j-th routed expert.
    weight: the top-k combine weight of part j (float32), else 0.
    """

    request_id: int
    position: int
    rank: int
    layer: LayerId
    data: np.ndarray
    part: int | None = None
    weight: float = 0.0

    @property
    def key(self) -> tuple[int, int, LayerId]:
        """Identity of the merged token: (request_id, position, layer)."""
        return (self.request_id, self.position, self.layer)

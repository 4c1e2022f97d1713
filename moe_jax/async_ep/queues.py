"""Per-layer FIFO token queues (the paper's mu-queues) of one device."""

from __future__ import annotations

import collections
from typing import Iterable

from moe_jax.async_ep.tokens import LayerId, Token


class LayerQueues:
    """One FIFO queue per hosted layer.

    Args:
      layers: the LayerIds this device hosts; pushing a token for any other
        layer raises ValueError.
    """

    def __init__(self, layers: Iterable[LayerId]):
        self._queues: dict[LayerId, collections.deque] = {
            layer: collections.deque() for layer in layers}

    @property
    def layers(self) -> tuple[LayerId, ...]:
        return tuple(self._queues)

    def push(self, token: Token) -> None:
        if token.layer not in self._queues:
            raise ValueError(f"token: layer {token.layer} is not hosted here")
        self._queues[token.layer].append(token)

    def pop(self, layer: LayerId, max_tokens: int) -> list[Token]:
        """Removes and returns up to `max_tokens` tokens of `layer`, oldest first."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        queue = self._queues[layer]
        return [queue.popleft() for _ in range(min(max_tokens, len(queue)))]

    def lengths(self) -> dict[LayerId, int]:
        """Queue length of every hosted layer (zeros included)."""
        return {layer: len(queue) for layer, queue in self._queues.items()}

    def total(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def __len__(self) -> int:
        return self.total()

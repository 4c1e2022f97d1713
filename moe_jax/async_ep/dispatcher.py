"""Layer placement and the dispatcher that routes layer outputs onward.

Placement: attention rank r (all blocks) and its sampler live on device
`rank_devices[r]`; expert e of every block on device `expert_devices[e]`
(AMoE colocates one layer type across all blocks). Two layouts:

  colocated:      attention DP ranks on devices 0..R-1, expert e on device
                  e % D (every device may run attention and experts);
  disaggregated:  attention ranks on devices 0..R-1 only, experts on the
                  other D - R devices (AMoE's default layout).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from moe_jax.async_ep import tokens as tk
from moe_jax.async_ep.model import embed
from moe_jax.async_ep.requests import Coordinator
from moe_jax.async_ep.tokens import LayerId, Token


@dataclasses.dataclass(frozen=True)
class Placement:
    """rank_devices[r]: device index of attention rank r; expert_devices[e]:
    device index of expert e; num_blocks: decoder blocks."""

    num_blocks: int
    rank_devices: tuple[int, ...]
    expert_devices: tuple[int, ...]

    @staticmethod
    def colocated(num_devices: int, num_ranks: int, num_experts: int, num_blocks: int):
        """Ranks on devices 0..R-1, expert e on device e % num_devices."""
        if not 1 <= num_ranks <= num_devices:
            raise ValueError(f"num_ranks must be in [1, {num_devices}], got {num_ranks}")
        return Placement(num_blocks, tuple(range(num_ranks)),
                         tuple(e % num_devices for e in range(num_experts)))

    @staticmethod
    def disaggregated(num_devices: int, num_attention_devices: int, num_experts: int,
                      num_blocks: int):
        """Rank r on device r (r < A); expert e on device A + e % (D - A)."""
        if not 1 <= num_attention_devices < num_devices:
            raise ValueError(f"num_attention_devices must be in [1, {num_devices - 1}], "
                             f"got {num_attention_devices}")
        experts_on = num_devices - num_attention_devices
        return Placement(num_blocks, tuple(range(num_attention_devices)),
                         tuple(num_attention_devices + e % experts_on
                               for e in range(num_experts)))

    @staticmethod
    def make(layout: str, num_devices: int, num_ranks: int, num_experts: int, num_blocks: int):
        """'colocated' or 'disaggregated' (then num_ranks attention devices)."""
        if layout == "colocated":
            return Placement.colocated(num_devices, num_ranks, num_experts, num_blocks)
        if layout == "disaggregated":
            return Placement.disaggregated(num_devices, num_ranks, num_experts, num_blocks)
        raise ValueError(f"layout must be 'colocated' or 'disaggregated', got {layout!r}")

    @property
    def num_devices(self) -> int:
        return max(self.rank_devices + self.expert_devices) + 1

    def device_of(self, layer: LayerId) -> int:
        if layer.kind == tk.EXPERT:
            return self.expert_devices[layer.index]
        return self.rank_devices[layer.index]

    def layers_on(self, device: int) -> list[LayerId]:
        """Every layer hosted by `device`, in forward order."""
        out = []
        for b in range(self.num_blocks):
            out += [tk.attention_layer(b, r) for r, d in enumerate(self.rank_devices) if d == device]
            out += [tk.expert_layer(b, e) for e, d in enumerate(self.expert_devices) if d == device]
        out += [tk.sampler_layer(self.num_blocks, r)
                for r, d in enumerate(self.rank_devices) if d == device]
        return out

    def after_block(self, block: int, rank: int) -> LayerId:
        """Where the merged output of `block` goes: next attention or the sampler."""
        if block + 1 < self.num_blocks:
            return tk.attention_layer(block + 1, rank)
        return tk.sampler_layer(self.num_blocks, rank)


class Dispatcher:
    """Labels layer outputs with their next LayerId and destination device.

    Every method returns a list of (device index, Token).
    """

    def __init__(self, placement: Placement, coordinator: Coordinator, params):
        self.placement = placement
        self.coordinator = coordinator
        self.params = params

    def after_attention(self, layer: LayerId, batch: Sequence[Token], h, u, expert_ids,
                        weights) -> list[tuple[int, Token]]:
        """Residual part to the pool of the next layer, k copies to the experts."""
        out = []
        nxt = self.placement.after_block(layer.block, layer.index)
        for i, t in enumerate(batch):
            out.append((self.placement.device_of(nxt),
                        Token(t.request_id, t.position, t.rank, nxt, h[i], part=-1)))
            for j in range(expert_ids.shape[1]):
                dest = tk.expert_layer(layer.block, expert_ids[i, j])
                out.append((self.placement.device_of(dest),
                            Token(t.request_id, t.position, t.rank, dest, u[i], part=j,
                                  weight=float(weights[i, j]))))
        return out

    def after_expert(self, layer: LayerId, batch: Sequence[Token], outputs):
        """Each output back to its request's rank, as part j of the next layer."""
        out = []
        for i, t in enumerate(batch):
            nxt = self.placement.after_block(layer.block, t.rank)
            out.append((self.placement.device_of(nxt),
                        Token(t.request_id, t.position, t.rank, nxt, outputs[i],
                              part=t.part, weight=t.weight)))
        return out

    def after_sampler(self, layer: LayerId, batch: Sequence[Token], sampled, now):
        """Next input token to block 0 of the same rank, unless the request is done."""
        out = []
        for i, t in enumerate(batch):
            nxt_token = self.coordinator.on_sampled(t.request_id, t.position, int(sampled[i]), now)
            if nxt_token is None:
                continue
            dest = tk.attention_layer(0, t.rank)
            out.append((self.placement.device_of(dest),
                        Token(t.request_id, t.position + 1, t.rank, dest,
                              embed(self.params, nxt_token, t.position + 1))))
        return out

    def first_token(self, request_id: int, rank: int, prompt) -> tuple[int, Token]:
        dest = tk.attention_layer(0, rank)
        return (self.placement.device_of(dest),
                Token(request_id, 0, rank, dest, embed(self.params, int(prompt[0]), 0)))


def as_batch(tokens: Sequence[Token]) -> tuple[np.ndarray, np.ndarray]:
    """Stacked data float32 [n, H] and positions int32 [n] of a batch."""
    return (np.stack([t.data for t in tokens]).astype(np.float32),
            np.asarray([t.position for t in tokens], np.int32))


def devices_and_placement(config, num_devices: int, num_ranks: int,
                          placement: Placement | None, platform: str = "cpu"):
    """The first `num_devices` JAX devices of `platform` ("cpu", "gpu", ...)
    and the placement on them (default: Placement.colocated); raises
    ValueError for an impossible device count."""
    import jax  # noqa: PLC0415

    devices = jax.devices(platform)
    if not 1 <= num_devices <= len(devices):
        raise ValueError(f"num_devices must be in [1, {len(devices)}], got {num_devices}")
    placement = placement or Placement.colocated(num_devices, num_ranks, config.num_experts,
                                                 config.num_blocks)
    if placement.num_devices > num_devices:
        raise ValueError(f"placement: uses {placement.num_devices} devices, "
                         f"num_devices is {num_devices}")
    return devices[:num_devices], placement

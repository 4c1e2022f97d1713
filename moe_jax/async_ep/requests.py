"""Requests and the coordinator (API server + load balancer) that tracks them.

Prefill is run token by token (teacher forcing): the token at position p <
len(prompt) - 1 is followed by prompt[p + 1] whatever the sampler says;
after that the sampled tokens are generated until `max_new_tokens`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence


@dataclasses.dataclass
class Request:
    """request_id: unique int; prompt: token ids (>= 1); max_new_tokens >= 1;
    arrival: tick (async) or step (sync) at which it may be admitted."""

    request_id: int
    prompt: Sequence[int]
    max_new_tokens: int
    arrival: float = 0

    def __post_init__(self):
        if len(self.prompt) < 1:
            raise ValueError(f"prompt of request {self.request_id} must not be empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def total_len(self) -> int:
        """Positions the request occupies in its KV cache."""
        return len(self.prompt) + self.max_new_tokens - 1


@dataclasses.dataclass
class RequestState:
    request: Request
    rank: int
    slot: int
    generated: list = dataclasses.field(default_factory=list)
    token_times: list = dataclasses.field(default_factory=list)
    token_walls: list = dataclasses.field(default_factory=list)  # time.perf_counter()
    admitted: float = 0
    done: bool = False


class Coordinator:
    """Admits requests to attention ranks (most free slots first, lowest rank on
    ties), frees slots on completion and records generated tokens.

    Args:
      num_ranks: attention DP ranks.
      slots_per_rank: concurrent requests per rank (KV cache slots).
      max_len: KV cache length; a longer request raises ValueError.
    """

    def __init__(self, num_ranks: int, slots_per_rank: int, max_len: int):
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if slots_per_rank < 1:
            raise ValueError(f"slots_per_rank must be >= 1, got {slots_per_rank}")
        self.max_len = max_len
        self.free = [list(range(slots_per_rank)) for _ in range(num_ranks)]
        self.states: dict[int, RequestState] = {}

    def admit(self, request: Request, now: float) -> RequestState | None:
        """Binds the request to a rank and slot; None when every slot is taken."""
        if request.total_len > self.max_len:
            raise ValueError(f"request {request.request_id}: needs {request.total_len} "
                             f"positions, max_len is {self.max_len}")
        if request.request_id in self.states:
            raise ValueError(f"request: duplicate request_id {request.request_id}")
        rank = max(range(len(self.free)), key=lambda r: (len(self.free[r]), -r))
        if not self.free[rank]:
            return None
        state = RequestState(request, rank, self.free[rank].pop(0), admitted=now)
        self.states[request.request_id] = state
        return state

    def on_sampled(self, request_id: int, position: int, token: int, now: float) -> int | None:
        """Records the sampler's output at `position`; returns the next input token
        id (at position + 1), or None when the request is complete."""
        state = self.states[request_id]
        prompt = state.request.prompt
        if position + 1 < len(prompt):
            return int(prompt[position + 1])
        state.generated.append(int(token))
        state.token_times.append(now)
        state.token_walls.append(time.perf_counter())
        if len(state.generated) >= state.request.max_new_tokens:
            state.done = True
            self.free[state.rank].append(state.slot)
            return None
        return int(token)

    def outputs(self) -> dict[int, list[int]]:
        return {rid: list(s.generated) for rid, s in self.states.items()}

    def all_done(self, requests: Sequence[Request]) -> bool:
        return all(r.request_id in self.states and self.states[r.request_id].done
                   for r in requests)

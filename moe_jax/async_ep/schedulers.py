"""Layer schedulers: which of a device's queues to drain next.

Interface: `scheduler.pick(queues, state) -> LayerId | None`, where `queues`
maps every layer the device hosts to its queue length and `state` says how
many blocks the pipeline has. None means every queue is empty.

* `MostTokensFirst` (MTFS): the longest queue.
* `FirstLayerFirst` (FLFS): the earliest non-empty layer of the forward pass.
  New requests enter at block 0, so a steady stream of arrivals keeps it at
  block 0 forever (livelock).
* `DefragScheduler` (Algorithm 1 of AMoE): score of a non-empty layer in
  block b = its queue length + sum_{k=1..K} delta^k * mass(b + k mod N),
  where mass(b') is the tokens queued here at block b' divided by the number
  of layers hosted here at block b'; the best score wins. N counts the
  sampler as one more block. Ties (up to 1e-9) go to the earlier layer.
* `HoldScheduler` ("hold"): cost-aware and not work-conserving. With a
  timed view (`pick_timed`, used by the routing-only simulation) it holds a
  queue while more of its wave is still upstream and running the fragment
  now would cost more than (1 + slack) x running the whole wave later, and
  releases it at a deadline. The default slack (2%) lets a wave split only
  where that is nearly free (above the largest bucket, or where the cost
  envelope is not convex): a split wave tends to stay split, so the extra
  fixed cost of a split is paid again at every later layer the halves
  pass apart (with 5%, workload T1's hot expert split its ~1,200 rows of a
  block into halves at 3.9% extra cost, and every expert of the bottleneck
  device then ran twice per step). A fragment cheap enough to run still waits
  while the device has a whole queue; a layer whose oldest token waited
  `escalate_s` (30 ms, as the released AMoE code) runs first. Among the
  queues it may run it takes the cheapest execution (shortest processing
  time first: the waves waiting behind it are released soonest), or with
  priority="score" the defrag score with the lookahead capped at stages - 1
  (no wrap onto itself), or with priority="phase" (wave groups kept at
  phase offsets, `routesim.phase_offsets`) the group furthest behind its
  place first, phase errors compared in whole stages (`phase_band`), then
  the cheapest execution. Without a timed view (`pick`) it is that capped
  defrag score alone, work-conserving.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Protocol

from moe_jax.async_ep.tokens import LayerId


@dataclasses.dataclass(frozen=True)
class SchedulerState:
    """What a scheduler may know besides the queue lengths.

    num_blocks: decoder blocks of the model; the sampler sits at block
      num_blocks, so lookahead wraps modulo num_blocks + 1.
    """

    num_blocks: int

    def __post_init__(self):
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


class Scheduler(Protocol):
    name: str

    def pick(self, queues: Mapping[LayerId, int], state: SchedulerState) -> LayerId | None:
        ...


def _nonempty(queues: Mapping[LayerId, int]) -> list[LayerId]:
    return sorted((layer for layer, n in queues.items() if n > 0),
                  key=lambda layer: (layer.order(), layer.index))


class MostTokensFirst:
    """Most-tokens-first-serve; ties go to the earlier layer."""

    name = "mtfs"

    def pick(self, queues, state):
        layers = _nonempty(queues)
        if not layers:
            return None
        return max(layers, key=lambda layer: (queues[layer], -layers.index(layer)))


class FirstLayerFirst:
    """First-layer-first-serve: lowest (block, attention < experts) non-empty layer."""

    name = "flfs"

    def pick(self, queues, state):
        layers = _nonempty(queues)
        return layers[0] if layers else None


class DefragScheduler:
    """AMoE's defragging scheduler.

    Args:
      lookahead: K, blocks looked ahead (int >= 0; default 7).
      decay: delta in (0, 1], the weight of a block k ahead is delta**k
        (default 0.8).
    """

    name = "defrag"

    def __init__(self, lookahead: int = 7, decay: float = 0.8):
        if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
            raise ValueError(f"lookahead must be an int >= 0, got {lookahead!r}")
        if not 0.0 < float(decay) <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.lookahead = lookahead
        self.decay = float(decay)

    def scores(self, queues: Mapping[LayerId, int], state: SchedulerState) -> dict[LayerId, float]:
        """Score of every non-empty layer."""
        num_stages = state.num_blocks + 1
        tokens = [0] * num_stages
        layers_at = [0] * num_stages
        for layer, n in queues.items():
            tokens[layer.block] += n
            layers_at[layer.block] += 1
        mass = [t / c if c else 0.0 for t, c in zip(tokens, layers_at)]
        out = {}
        for layer in _nonempty(queues):
            ahead = sum(mass[(layer.block + k) % num_stages] * self.decay ** k
                        for k in range(1, self.lookahead + 1))
            out[layer] = queues[layer] + ahead
        return out

    def pick(self, queues, state):
        scores = self.scores(queues, state)
        if not scores:
            return None
        # Scores equal up to rounding (1e-9) are ties; ties go to the earlier layer.
        best, best_score = None, None
        for layer, score in scores.items():  # already in forward order
            score = round(score, 9)
            if best is None or score > best_score:
                best, best_score = layer, score
        return best


class HoldScheduler(DefragScheduler):
    """Cost-aware, non-work-conserving scheduler (see the module docstring).

    Args:
      hold_s: longest a queue is held for the rest of its wave (seconds).
      escalate_s: a layer whose oldest token waited this long runs first.
      slack: hold only if cost(queued) + cost(incoming) > (1 + slack) *
        cost(queued + incoming) (default 0.02; see the module docstring).
      idle_wait: hold even when the device has nothing else to run (the
        device then sleeps until a delivery or the earliest deadline).
      whole_first: a fragment cheap enough to run (within slack) still waits
        while the device has a whole queue to run.
      priority: among the queues it may run, "score" takes the best defrag
        score, "shortest" the cheapest execution (shortest processing time
        first: the other waves on the device are released soonest).
      lookahead, decay: the defrag score; lookahead is capped at stages - 1.
      phase_band: with priority="phase", phase errors are compared in units
        of this many stages (rounded; default 1, the offsets' granularity):
        groups within about half a band of each other count as level and the
        cheapest execution decides; 0 compares them exactly.
    """

    name = "hold"

    def __init__(self, hold_s: float = 1e-3, escalate_s: float = 0.030, slack: float = 0.02,
                 idle_wait: bool = True, lookahead: int = 7, decay: float = 0.8,
                 whole_first: bool = True, priority: str = "shortest", phase_band: float = 1.0):
        super().__init__(lookahead=lookahead, decay=decay)
        if not hold_s >= 0 or not escalate_s > 0 or not slack >= 0:
            raise ValueError(f"hold_s, slack must be >= 0 and escalate_s > 0, got "
                             f"{hold_s!r}, {escalate_s!r}, {slack!r}")
        self.hold_s = float(hold_s)
        self.escalate_s = float(escalate_s)
        self.slack = float(slack)
        self.idle_wait = bool(idle_wait)
        self.whole_first = bool(whole_first)
        if priority not in ("score", "shortest", "phase"):
            raise ValueError(f"priority must be 'score', 'shortest' or 'phase', got {priority!r}")
        self.priority = priority
        if not phase_band >= 0:
            raise ValueError(f"phase_band must be >= 0, got {phase_band!r}")
        self.phase_band = float(phase_band)

    def scores(self, queues, state):
        num_stages = state.num_blocks + 1
        capped = min(self.lookahead, num_stages - 1)
        saved, self.lookahead = self.lookahead, capped
        try:
            return super().scores(queues, state)
        finally:
            self.lookahead = saved

    def decide(self, now: float, entries, cost) -> tuple[list, list, list, object]:
        """Splits non-empty layers into (whole, fragments, deadlines, escalated).

        entries: (layer, queued n, enqueue time of the oldest, incoming rows);
        cost(kind, n) -> seconds. A queue is whole when nothing of its wave is
        upstream or its deadline has passed; a fragment otherwise. A fragment
        is held (its deadline listed) when running it now and the rest later
        costs more than (1 + slack) x running them together, else it is
        runnable (listed in fragments). escalated is the layer to run at
        once, or None.
        """
        late = [e for e in entries if now >= e[2] + self.escalate_s]
        if late:
            return [], [], [], min(late, key=lambda e: (e[2], e[0].order(), e[0].index))[0]
        whole, fragments, deadlines = [], [], []
        for layer, n, oldest, incoming in entries:
            # compared with the deadline itself (not now - oldest), so that a
            # wake-up at the deadline always releases the queue
            if incoming > 0 and now < oldest + self.hold_s:
                more = int(math.ceil(incoming))
                split = cost(layer.kind, n) + cost(layer.kind, more)
                if split > (1.0 + self.slack) * cost(layer.kind, n + more):
                    deadlines.append(oldest + self.hold_s)
                else:
                    fragments.append(layer)
                continue
            whole.append(layer)
        return whole, fragments, deadlines, None

    def pick_timed(self, now: float, queues: Mapping[LayerId, int], entries, cost,
                   state: SchedulerState, phase=None) -> tuple[LayerId | None, float | None]:
        """(layer to run now or None, time to look again or None).

        Whole queues go first (with whole_first); a runnable fragment runs
        only when the device has no whole queue; held fragments wait for
        their deadline (with idle_wait; otherwise an idle device runs one).
        phase: with priority="phase", one number per entry (the entry's wave
        group's progress in stages plus the stages that group is meant to
        trail the first group); the lowest (the group furthest behind its
        place) runs first, then the cheapest execution."""
        whole, fragments, deadlines, escalated = self.decide(now, entries, cost)
        if escalated is not None:
            return escalated, None
        runnable = whole if (self.whole_first and whole) else whole + fragments
        if not runnable:
            if not deadlines:
                return None, None
            if self.idle_wait:
                return None, min(deadlines)
            runnable = [e[0] for e in entries]
        if self.priority == "phase" and phase is not None:
            n_of = {e[0]: e[1] for e in entries}
            band = self.phase_band
            q_of = {e[0]: (round(q / band) if band else q) for e, q in zip(entries, phase)}
            best = min(runnable, key=lambda layer: (q_of[layer], cost(layer.kind, n_of[layer]),
                                                    layer.order(), layer.index))
            return best, None
        if self.priority in ("shortest", "phase"):
            n_of = {e[0]: e[1] for e in entries}
            best = min(runnable, key=lambda layer: (cost(layer.kind, n_of[layer]),
                                                    layer.order(), layer.index))
            return best, None
        scores = self.scores({layer: queues[layer] for layer in queues}, state)
        best = max(runnable, key=lambda layer: (round(scores[layer], 9),
                                                -layer.order(), -layer.index))
        return best, None


def make_scheduler(name: str, **kwargs) -> Scheduler:
    """"defrag" (kwargs: lookahead, decay), "hold" (HoldScheduler's kwargs),
    "mtfs" or "flfs"."""
    if name == "defrag":
        return DefragScheduler(**kwargs)
    if name == "hold":
        return HoldScheduler(**kwargs)
    if kwargs:
        raise ValueError(f"kwargs: scheduler {name!r} takes none, got {sorted(kwargs)}")
    if name == "mtfs":
        return MostTokensFirst()
    if name == "flfs":
        return FirstLayerFirst()
    raise ValueError(f"name must be 'defrag', 'hold', 'mtfs' or 'flfs', got {name!r}")

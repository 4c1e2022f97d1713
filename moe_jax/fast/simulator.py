"""Analytical two-tier (scale-up / scale-out) completion-time model.

Like the FAST paper's simulator (NSDI '26, section 5.4, which follows TACCL
and TE-CCL), a schedule is a sequence of steps and each step costs a fixed
link wake-up delay ``alpha`` plus ``bytes / bandwidth`` of its busiest port.
Every GPU has one scale-up port and one scale-out NIC, each full duplex; a
step's cost on a tier is ``alpha + max over GPUs of max(sent, received) /
bandwidth`` (zero when the step moves nothing on that tier).

Steps that overlap in time (FAST's balancing, intra-server part and
redistributions on the scale-up tier) are charged by one of two port models
(``ports=``):

* ``"duplex"`` (default): every GPU has four ports, scale-up send, scale-up
  receive, NIC send, NIC receive, each with its own free time
  (``DuplexPorts``).  A step ready at time ``r`` occupies each port it uses
  from ``max(r, port free)`` for ``alpha + bytes / bandwidth`` and ends with
  its last port; work on different GPUs, or on the two directions of one
  GPU, overlaps, work on one port queues in issue order.  An isolated step
  costs ``alpha + max over GPUs of max(sent, received) / bandwidth``.  The
  model couples a transfer's two ports only through its step's end, so it
  is the per-port (fluid) optimum of each step, not a flow-level schedule.
* ``"shared"``: one timeline per tier: scale-up steps run back to back
  whatever GPUs and directions they use (the earlier model).

Both tiers' stages of one schedule (FAST's BvN scale-out stages, SpreadOut's
stages) stay synchronous: a stage starts when the previous one has ended.

Link defaults (bandwidths as in the paper; the paper gives no value for the
wake-up delay, so the ``alpha`` values are our assumptions):

* ``NVLINK_H100`` / ``NVLINK_H200``: 450 GB/s per GPU ("450 GBps 4th-gen
  NVLink", the paper's H100 bound and its H200 testbed, 9:1 over scale-out),
  alpha 2 us.
* ``NVLINK5``: 900 GB/s per GPU (the paper's "5th-gen NVLink 900 GBps").
* ``IB_400G``: 400 Gb/s = 50 GB/s per NIC (the paper's H200 testbed and
  simulation), alpha 5 us.
* ``ETH_400G``: 400 Gb/s Ethernet = 50 GB/s per NIC, alpha 10 us.

Traffic matrices are in bytes: int[G, G], GPU ``g`` is local GPU ``g % M`` of
server ``g // M``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_jax.fast import reference as ref


@dataclasses.dataclass(frozen=True)
class Link:
  """alpha (s) + bytes / bandwidth (bytes/s) per step, per port."""
  alpha_s: float
  bandwidth_Bps: float

  def __post_init__(self):
    if self.alpha_s < 0:
      raise ValueError(f"alpha_s must be >= 0, got {self.alpha_s}")
    if self.bandwidth_Bps <= 0:
      raise ValueError(f"bandwidth_Bps must be > 0, got {self.bandwidth_Bps}")


NVLINK_H100 = Link(2e-6, 450e9)
NVLINK_H200 = Link(2e-6, 450e9)
NVLINK5 = Link(2e-6, 900e9)
IB_400G = Link(5e-6, 50e9)
ETH_400G = Link(10e-6, 50e9)


PORT_MODELS = ("duplex", "shared")


@dataclasses.dataclass(frozen=True)
class Fabric:
  scale_up: Link = NVLINK_H200
  scale_out: Link = IB_400G


def _step_cost(link: Link, sent: np.ndarray, recv: np.ndarray) -> float:
  peak = max(float(sent.max(initial=0)), float(recv.max(initial=0)))
  return 0.0 if peak == 0 else link.alpha_s + peak / link.bandwidth_Bps


def bound_time(traffic, num_servers: int, gpus_per_server: int,
               fabric: Fabric = Fabric()) -> float:
  """The paper's optimum: infinitely fast scale-up, so the heaviest server
  (row/column sum of the server matrix) spread over its ``M`` NICs."""
  lb = ref.lower_bounds(traffic, num_servers, gpus_per_server)["server"]
  return lb / (gpus_per_server * fabric.scale_out.bandwidth_Bps)


def two_tier_bound_time(traffic, num_servers: int, gpus_per_server: int,
                        fabric: Fabric = Fabric()) -> float:
  """A lower bound (s) that also counts the scale-up ports.

  ``max(bound_time, max over GPUs g and directions of
  max(I_g / B_up, X_g / (B_up + B_out)))``, where ``X_g`` is the bytes GPU
  ``g`` sends to (receives from) other GPUs, ``I_g`` the part of it to
  (from) GPUs of its own server, ``B_up`` / ``B_out`` the scale-up /
  scale-out bandwidths per GPU and direction.  Alphas are left out.

  Why no schedule on this fabric finishes in less time ``T``, for any
  routing of inter-server bytes (relayed through any GPUs and servers) as
  long as intra-server bytes stay on the scale-up tier (true of FAST,
  SpreadOut and direct):

  * ``bound_time``: every inter-server byte of server ``a`` leaves ``a``
    through one of its ``M`` NIC send ports (enters through a NIC receive
    port), which carry at most ``M B_out T`` bytes in ``T``.
  * ``I_g / B_up``: the ``I_g`` intra-server bytes leave ``g`` (enter ``g``)
    through its scale-up send (receive) port, which carries at most
    ``B_up T``.
  * ``X_g / (B_up + B_out)``: a GPU's only ports are its scale-up and NIC
    ports, so its ``X_g`` bytes leave (enter) through them:
    ``X_g <= B_up T + B_out T``.  (Bytes relayed through ``g`` only add to
    both ports' loads.)
  """
  t = ref._check_traffic(traffic, num_servers, gpus_per_server).astype(float)
  m = gpus_per_server
  srv = np.arange(t.shape[0]) // m
  off = t.copy()
  np.fill_diagonal(off, 0.0)
  intra = np.where(srv[:, None] == srv[None, :], off, 0.0)
  up, out = fabric.scale_up.bandwidth_Bps, fabric.scale_out.bandwidth_Bps
  per_gpu = max(float(np.max(off.sum(axis=ax), initial=0.0))
                for ax in (0, 1)) / (up + out)
  intra_only = max(float(np.max(intra.sum(axis=ax), initial=0.0))
                   for ax in (0, 1)) / up
  return max(bound_time(t, num_servers, m, fabric), per_gpu, intra_only)


class DuplexPorts:
  """Send and receive free times (s) of every GPU's port on one tier."""

  def __init__(self, num_gpus: int, link: Link):
    self.link = link
    self.send_free = np.zeros(num_gpus)
    self.recv_free = np.zeros(num_gpus)

  def _occupy(self, free: np.ndarray, nbytes: np.ndarray, ready: float
              ) -> float:
    used = nbytes > 0
    if not used.any():
      return ready
    free[used] = (np.maximum(free[used], ready) + self.link.alpha_s
                  + nbytes[used] / self.link.bandwidth_Bps)
    return float(free[used].max())

  def step(self, sent: np.ndarray, recv: np.ndarray, ready: float) -> float:
    """End time (s) of a step ready at ``ready`` that sends ``sent[g]`` and
    receives ``recv[g]`` bytes (float[G]) per GPU; ``ready`` when empty."""
    return max(self._occupy(self.send_free, sent, ready),
               self._occupy(self.recv_free, recv, ready))


def stage_loads(rows: np.ndarray, num_stages: int, num_gpus: int
                ) -> tuple[np.ndarray, np.ndarray]:
  """float64[2 + 2S, G] sent and received bytes per stage and GPU.

  ``rows``: int[K, 6] (stage, src, dst, amount, flow_src, flow_dst) as in
  ``moe_jax._fast``; stage 0 balance, 1 intra, 2 + 2k scale-out of BvN stage
  k, 3 + 2k its redistribution.
  """
  rows = np.asarray(rows, np.int64).reshape(-1, 6)
  shape = (2 + 2 * num_stages, num_gpus)
  sent = np.zeros(shape[0] * shape[1])
  recv = np.zeros_like(sent)
  np.add.at(sent, rows[:, 0] * num_gpus + rows[:, 1], rows[:, 3])
  np.add.at(recv, rows[:, 0] * num_gpus + rows[:, 2], rows[:, 3])
  return sent.reshape(shape), recv.reshape(shape)


def schedule_rows(schedule: ref.Schedule) -> np.ndarray:
  """int64[K, 6] rows of a reference Schedule (stage ids as in stage_loads)."""
  out = []
  for i, st in enumerate(schedule.stages):
    for t in st.transfers:
      out.append((i, t.src_gpu, t.dst_gpu, t.amount, *t.flow))
  return np.asarray(out, np.int64).reshape(-1, 6)


def _rows_cost(link: Link, rows: np.ndarray, num_gpus: int) -> float:
  """One step of ``rows`` (int[K, 6]) on ``link``."""
  sent = np.bincount(rows[:, 1], rows[:, 3], minlength=num_gpus)
  recv = np.bincount(rows[:, 2], rows[:, 3], minlength=num_gpus)
  return _step_cost(link, sent, recv)


def first_stages_from_rows(rows, num_servers: int, gpus_per_server: int
                           ) -> np.ndarray:
  """int64[n, n]: first BvN stage with a scale-out row from server ``a`` to
  server ``b`` (-1 when none); ``reference.first_stages`` from rows."""
  rows = np.asarray(rows, np.int64).reshape(-1, 6)
  n, m = num_servers, gpus_per_server
  out = rows[(rows[:, 0] >= 2) & (rows[:, 0] % 2 == 0)]
  first = np.full(n * n, np.iinfo(np.int64).max)
  np.minimum.at(first, out[:, 1] // m * n + out[:, 2] // m, (out[:, 0] - 2) // 2)
  first[first == np.iinfo(np.int64).max] = -1
  return first.reshape(n, n)


def balance_stages_from_rows(rows, num_servers: int, gpus_per_server: int
                             ) -> np.ndarray:
  """int64[K]: for each balancing row (stage 0), the BvN stage it must
  precede (its server pair's first stage); -1 for every other row."""
  rows = np.asarray(rows, np.int64).reshape(-1, 6)
  m = gpus_per_server
  first = first_stages_from_rows(rows, num_servers, m)
  due = first[rows[:, 1] // m, rows[:, 5] // m]
  return np.where(rows[:, 0] == 0, due, -1)


def balance_rows_by_use(rows) -> tuple[np.ndarray, np.ndarray]:
  """Balancing split by use: (rows int64[K', 6], due int64[K']).

  A GPU only holds another GPU's units of a flow through balancing, and
  the giver is the flow's source (givers hand over their own tail pieces),
  so every scale-out row whose sender is not the flow's source is the use
  of balanced units: (stage k, j, peer, y, (s, d)) needs y units moved
  s -> j before stage k.  The balancing rows (stage 0) are replaced by one
  such row per use, due before its stage k (``due``; -1 for the other
  rows).  Per (src, dst, flow) they add up to the original balancing.
  """
  rows = np.asarray(rows, np.int64).reshape(-1, 6)
  st = rows[:, 0]
  used = rows[(st >= 2) & (st % 2 == 0) & (rows[:, 1] != rows[:, 4])]
  bal = np.stack([np.zeros(len(used), np.int64), used[:, 4], used[:, 1],
                  used[:, 3], used[:, 4], used[:, 5]], axis=1)
  rest = rows[st != 0]
  return (np.concatenate([bal, rest]),
          np.concatenate([(used[:, 0] - 2) // 2,
                          np.full(len(rest), -1, np.int64)]))


def _sequential_time(rows, num_stages, g, fabric) -> dict:
  sent, recv = stage_loads(rows, num_stages, g)
  up, out = fabric.scale_up, fabric.scale_out
  t_bal = _step_cost(up, sent[0], recv[0])
  t_intra = _step_cost(up, sent[1], recv[1])
  out_end = t_bal
  up_free = t_bal + t_intra
  so = red = 0.0
  for k in range(num_stages):
    c_out = _step_cost(out, sent[2 + 2 * k], recv[2 + 2 * k])
    c_red = _step_cost(up, sent[3 + 2 * k], recv[3 + 2 * k])
    out_end += c_out
    up_free = max(out_end, up_free) + c_red
    so += c_out
    red += c_red
  return {"total": max(out_end, up_free), "balance": t_bal,
          "balance_exposed": t_bal, "intra": t_intra, "scale_out": so,
          "redistribute": red}


def _window_scale_up_costs(rows, due, num_stages, g, up: Link) -> np.ndarray:
  """float64[S + 1]: scale-up cost of window k < S (balancing due before
  stage k + 1, redistribution of stage k - 1, intra in window 0) and, at
  index S, of the exposed last redistribution.  Parts of a window share
  each GPU's port; every non-empty part pays its own alpha."""
  st = rows[:, 0]
  is_red = (st >= 3) & (st % 2 == 1)
  window = np.full(st.shape, -1, np.int64)
  window[st == 0] = due[st == 0] - 1  # due 0 is the exposed head
  window[st == 1] = 0
  window[is_red] = (st[is_red] - 3) // 2 + 1
  part = np.select([st == 0, st == 1], [0, 1], 2)
  keep = window >= 0
  rows, window, part = rows[keep], window[keep], part[keep]
  slots = num_stages + 1
  sent = np.bincount(window * g + rows[:, 1], rows[:, 3], slots * g)
  recv = np.bincount(window * g + rows[:, 2], rows[:, 3], slots * g)
  peak = np.maximum(sent, recv).reshape(slots, g).max(axis=1)
  parts = np.zeros((slots, 3), bool)
  parts[window, part] = True
  return parts.sum(axis=1) * up.alpha_s + peak / up.bandwidth_Bps


def _windows_time(rows, num_stages, num_servers, m, fabric) -> dict:
  """Per-stage windows (``pipeline_balance="windows"``)."""
  g = num_servers * m
  up, out = fabric.scale_up, fabric.scale_out
  seq = _sequential_time(rows, num_stages, g, fabric)
  if num_stages == 0:
    return dict(seq, total=seq["intra"], balance_starts=[])
  due = balance_stages_from_rows(rows, num_servers, m)
  head = _rows_cost(up, rows[(rows[:, 0] == 0) & (due == 0)], g)
  c_up = _window_scale_up_costs(rows, due, num_stages, g, up)
  c_out = _scale_out_costs(rows, num_stages, g, out)
  windows = np.maximum(c_out, c_up[:num_stages])
  return dict(seq, total=head + float(windows.sum()) + float(c_up[-1]),
              balance_exposed=head, balance_starts=list(range(num_stages)))


def _scale_out_costs(rows, num_stages, g, out: Link) -> np.ndarray:
  sent, recv = stage_loads(rows, num_stages, g)
  return np.array([_step_cost(out, sent[2 + 2 * k], recv[2 + 2 * k])
                   for k in range(num_stages)])


def _chunk_loads(rows, due, starts, g) -> tuple[np.ndarray, np.ndarray]:
  """float64[J, G] sent and received balancing bytes of chunk j (pairs due
  in stages ``starts[j] <= k < starts[j + 1]``) per GPU."""
  bal = rows[rows[:, 0] == 0]
  chunk = np.searchsorted(starts, due[rows[:, 0] == 0], side="right") - 1
  j = len(starts)
  sent = np.bincount(chunk * g + bal[:, 1], bal[:, 3], j * g).reshape(j, g)
  recv = np.bincount(chunk * g + bal[:, 2], bal[:, 3], j * g).reshape(j, g)
  return sent, recv


def _chunk_costs(rows, due, starts, g, up: Link) -> np.ndarray:
  """float64[J]: scale-up cost of balancing chunk j as one step."""
  sent, recv = _chunk_loads(rows, due, starts, g)
  return np.array([_step_cost(up, sent[i], recv[i])
                   for i in range(len(starts))])


def _duplex_time_at(starts, rows, due, loads, c_out, g, fabric
                    ) -> tuple[float, float]:
  """(total, exposed head) of the chunked schedule on ``DuplexPorts``.

  ``loads``: ``stage_loads`` of ``rows``; ``c_out``: float[S] scale-out
  stage costs.  Issue order on the scale-up ports: balancing chunks (ready
  at 0), the intra-server part (ready at 0), then redistribution k, ready
  when scale-out stage k ends; scale-out stage k starts when stage k - 1
  has ended and chunk ``chunk_of[k]`` is done.
  """
  sent, recv = loads
  up = DuplexPorts(g, fabric.scale_up)
  bal_sent, bal_recv = _chunk_loads(rows, due, starts, g)
  done = [up.step(bal_sent[j], bal_recv[j], 0.0) for j in range(len(starts))]
  end = up.step(sent[1], recv[1], 0.0)
  chunk_of = np.searchsorted(starts, np.arange(len(c_out)), side="right") - 1
  out_end = 0.0
  for k, c in enumerate(c_out):
    out_end = max(out_end, done[chunk_of[k]]) + c
    end = max(end, up.step(sent[3 + 2 * k], recv[3 + 2 * k], out_end))
  return max(end, out_end, max(done)), float(done[0])


def _chunked_time_at(starts, rows, due, c_out, c_red, t_intra, g, up
                     ) -> tuple[float, float]:
  """(total, exposed head) with balancing chunks starting at ``starts``."""
  c_bal = _chunk_costs(rows, due, starts, g, up)
  done = np.cumsum(c_bal)  # chunks back to back on the scale-up port
  chunk_of = np.searchsorted(starts, np.arange(len(c_out)), side="right") - 1
  out_end = 0.0
  ends = np.empty(len(c_out))
  for k, c in enumerate(c_out):
    out_end = max(out_end, done[chunk_of[k]]) + c
    ends[k] = out_end
  up_free = done[-1] + t_intra
  for k, c in enumerate(c_red):
    up_free = max(ends[k], up_free) + c
  return max(out_end, up_free), float(c_bal[0])


def candidate_starts(num_stages: int) -> list[np.ndarray]:
  """Chunkings tried: one chunk (the sequential schedule) and geometric
  chunk starts ``0, floor(c r^j)`` for a few first stages c and ratios r."""
  cands = [np.zeros(1, np.int64)]
  for c in (1, 2, 4, 8):
    for r in (1.25, 1.5, 2.0, 3.0, 4.0):
      pts = [0]
      x = float(c)
      while int(x) < num_stages:
        if int(x) > pts[-1]:
          pts.append(int(x))
        x *= r
      cands.append(np.asarray(pts, np.int64))
  return cands


def pair_balance_costs(rows, num_servers: int, gpus_per_server: int,
                       up: Link) -> np.ndarray:
  """float64[n, n]: scale-up cost of pair (a, b)'s balancing as one step."""
  n, m = num_servers, gpus_per_server
  bal = rows[rows[:, 0] == 0]
  pair = bal[:, 1] // m * n + bal[:, 5] // m
  g = n * m
  sent = np.bincount(pair * g + bal[:, 1], bal[:, 3], n * n * g)
  recv = np.bincount(pair * g + bal[:, 2], bal[:, 3], n * n * g)
  peak = np.maximum(sent, recv).reshape(n * n, g).max(axis=1)
  return np.where(peak > 0, up.alpha_s + peak / up.bandwidth_Bps,
                  0.0).reshape(n, n)


def light_balance_first_order(rows, num_stages: int, num_servers: int,
                              gpus_per_server: int, up: Link) -> np.ndarray:
  """int64[S]: BvN stages by ascending heaviest pair balancing (ties in
  stage order), so the stages that need little balancing run first and
  the heavy balancing overlaps their scale-out.  Any order of BvN stages
  is a valid schedule (each stage moves what its GPUs hold after
  balancing)."""
  n, m = num_servers, gpus_per_server
  cost = pair_balance_costs(rows, n, m, up)
  out = rows[(rows[:, 0] >= 2) & (rows[:, 0] % 2 == 0)]
  need = np.zeros(num_stages)
  np.maximum.at(need, (out[:, 0] - 2) // 2,
                cost[out[:, 1] // m, out[:, 2] // m])
  return np.argsort(need, kind="stable")


def _stage_peaks(rows, key, num_stages, g) -> np.ndarray:
  """float64[S]: busiest port (max of sent, received) of rows grouped by
  ``key`` (int[K] in [0, S))."""
  sent = np.bincount(key * g + rows[:, 1], rows[:, 3], num_stages * g)
  recv = np.bincount(key * g + rows[:, 2], rows[:, 3], num_stages * g)
  return np.maximum(sent, recv).reshape(num_stages, g).max(axis=1)


def ends_light_order(rows, num_stages: int, num_gpus: int) -> np.ndarray:
  """int64[S]: BvN stages with the least balancing by use first and the
  rest by descending redistribution, so each stage's redistribution hides
  behind the later stages' scale-out and the exposed tail is the lightest.

  The first stage's balancing (``balance_rows_by_use``) and the last
  stages' redistribution are the parts no scale-out overlaps.
  """
  if num_stages == 0:
    return np.zeros(0, np.int64)
  rows = np.asarray(rows, np.int64).reshape(-1, 6)
  bal, due = balance_rows_by_use(rows)
  use = bal[:, 0] == 0
  need = _stage_peaks(bal[use], due[use], num_stages, num_gpus)
  st = rows[:, 0]
  red = rows[(st >= 3) & (st % 2 == 1)]
  forward = _stage_peaks(red, (red[:, 0] - 3) // 2, num_stages, num_gpus)
  first = int(np.argmin(need))
  rest = np.argsort(-forward, kind="stable")
  return np.concatenate([[first], rest[rest != first]]).astype(np.int64)


def reorder_stages(rows, order) -> np.ndarray:
  """Rows with BvN stage ``order[i]`` relabelled as stage ``i`` (scale-out
  and redistribution alike); balancing and intra rows unchanged."""
  rows = np.array(rows, np.int64).reshape(-1, 6)
  pos = np.empty(len(order), np.int64)
  pos[np.asarray(order, np.int64)] = np.arange(len(order))
  bvn = rows[:, 0] >= 2
  k = (rows[bvn, 0] - 2) // 2
  rows[bvn, 0] = 2 + 2 * pos[k] + (rows[bvn, 0] - 2) % 2
  return rows


BALANCE_TIMINGS = ("pair", "use")


def _balanced_layout(rows, order, timing, num_servers, m):
  """(rows, due) of the schedule with stages in ``order`` and balancing
  due by pair (its pair's first stage) or by use
  (``balance_rows_by_use``)."""
  ordered = reorder_stages(rows, order)
  if timing == "use":
    return balance_rows_by_use(ordered)
  return ordered, balance_stages_from_rows(ordered, num_servers, m)


def _chunked_time(rows, num_stages, num_servers, m, fabric,
                  ports: str = "duplex", candidates=None,
                  timings=BALANCE_TIMINGS) -> dict:
  """Chunked pipelined balancing: the least total over the balancing
  timings ``timings``, the stage orders (as built, light balancing first,
  ends light) and the chunkings ``candidates`` (default
  ``candidate_starts``, plus one chunk per stage for balancing by use) on
  the ``ports`` model."""
  g = num_servers * m
  up = fabric.scale_up
  seq = _sequential_time(rows, num_stages, g, fabric)
  if num_stages == 0:
    return dict(seq, total=max(seq["balance"], seq["intra"])
                if ports == "duplex" else seq["total"],
                balance_starts=[0], stage_order=[], balance_timing="pair")
  if candidates is None:
    candidates = candidate_starts(num_stages)
  orders = (np.arange(num_stages),
            light_balance_first_order(rows, num_stages, num_servers, m, up),
            ends_light_order(rows, num_stages, g))
  best = None
  for timing in timings:
    cands = list(candidates)
    if timing == "use":
      cands.append(np.arange(num_stages))
    for order in orders:
      laid, due = _balanced_layout(rows, order, timing, num_servers, m)
      c_out = _scale_out_costs(laid, num_stages, g, fabric.scale_out)
      sent, recv = stage_loads(laid, num_stages, g)
      c_red = [_step_cost(up, sent[3 + 2 * k], recv[3 + 2 * k])
               for k in range(num_stages)]
      for starts in cands:
        if ports == "duplex":
          total, head = _duplex_time_at(starts, laid, due, (sent, recv),
                                        c_out, g, fabric)
        else:
          total, head = _chunked_time_at(starts, laid, due, c_out, c_red,
                                         seq["intra"], g, up)
        if best is None or total < best[0]:
          best = (total, head, starts, order, timing)
  total, head, starts, order, timing = best
  return dict(seq, total=total, balance_exposed=head,
              balance_starts=starts.tolist(), stage_order=order.tolist(),
              balance_timing=timing)


def fast_time_from_rows(rows, num_stages: int, num_servers: int,
                        gpus_per_server: int, fabric: Fabric = Fabric(),
                        pipeline_balance: bool | str = True,
                        ports: str = "duplex",
                        balance_timings=BALANCE_TIMINGS) -> dict:
  """Completion time of a FAST schedule, in seconds.

  ``rows``: int[K, 6] as in ``stage_loads``; ``num_stages``: BvN stages S.
  Every model charges each step ``alpha + busiest port / bandwidth``; the
  intra-server part is one scale-up step next to the first scale-out stage.
  Scale-out stages run back to back (stage k + 1 after stage k).

  ``ports``: how overlapping scale-up steps share the scale-up ports.
  ``"duplex"`` (default): per GPU and direction (``DuplexPorts``); the
  balancing chunks, the intra-server part and the redistributions are
  issued in that order, each on the ports it uses, so the balancing's
  sends from hot senders overlap the redistribution's receives into hot
  receivers.  ``"shared"``: one scale-up timeline: every scale-up step
  starts after the previous one ended, whatever GPUs it uses (the
  descriptions below are this model; ``"duplex"`` replaces "after the
  previous scale-up work" with "after the previous work on the same
  ports").  ``pipeline_balance="windows"`` ignores ``ports``.

  ``pipeline_balance=False`` (sequential, the paper's Fig. 11): all
  balancing as one step first; scale-out stages back to back after it;
  redistribution of stage k starts when stage k's scale-out and the
  previous scale-up work are done (scale-up work is serialised, scale-out
  overlaps it).

  ``pipeline_balance=True`` (chunked): the balancing of server pair (a, b)
  is only due before the pair's first BvN stage
  (``balance_stages_from_rows``).  The stages are cut into chunks at
  ``starts`` (0 = s_0 < s_1 < ...); chunk j's balancing (pairs due in
  stages s_j .. s_{j+1} - 1) is one scale-up step, the chunks run back to
  back on the scale-up port from time 0, and scale-out stage k waits for
  the chunk holding its pairs (chunk 0 is exposed).  Then the intra-server
  part and the redistributions follow on the scale-up port as in the
  sequential model.  One chunk is exactly the sequential model; the
  chunking with the least total among ``candidate_starts`` is used and
  returned, so the result is never above the sequential one.  With
  ``"use"`` in ``balance_timings`` (default: both) the balancing may also
  be timed by use (``balance_rows_by_use``: each balanced unit due before
  the stage that sends it, chunks as above, plus one chunk per stage), and
  the stage orders tried include ``ends_light_order``; the best of all is
  returned (``balance_timing``: ``"pair"`` or ``"use"``).

  ``pipeline_balance="windows"``: per-stage windows; the balancing due
  before stage 0 is exposed, window k = 0 .. S-1 costs ``max(scale-out of
  stage k, scale-up step of {balancing due before stage k + 1,
  redistribution of stage k - 1, intra if k == 0})`` (shared per-GPU
  ports, one alpha per non-empty part), the last redistribution is
  exposed.  Splitting the balancing per stage gives up the aggregation of
  one step (each stage pays its own busiest GPU), and a window cannot use
  the slack of another, so on skewed traffic this is slower than both.

  Returns dict with ``total``, ``balance`` (cost of the whole balancing as
  one step), ``balance_exposed`` (the balancing before the first scale-out:
  all of it sequentially, chunk 0 pipelined), ``intra``, ``scale_out`` (sum
  of stage costs), ``redistribute`` (sum of stage costs), and, pipelined,
  ``balance_starts`` (the chunk starts used) and ``stage_order``
  (``stage_order[i]`` = the BvN stage run i-th).
  """
  if ports not in PORT_MODELS:
    raise ValueError(f"ports must be one of {PORT_MODELS}, got {ports!r}")
  rows = np.asarray(rows, np.int64).reshape(-1, 6)
  g = num_servers * gpus_per_server
  if pipeline_balance == "windows":
    return _windows_time(rows, num_stages, num_servers, gpus_per_server,
                         fabric)
  if not pipeline_balance:
    if ports == "shared":
      return _sequential_time(rows, num_stages, g, fabric)
    return _duplex_in_order(rows, num_stages, num_servers, gpus_per_server,
                            fabric)
  return _chunked_time(rows, num_stages, num_servers, gpus_per_server, fabric,
                       ports, timings=tuple(balance_timings))


def _duplex_in_order(rows, num_stages, num_servers, m, fabric) -> dict:
  """Sequential time (one balancing chunk, stages in built order) on
  ``DuplexPorts``."""
  g = num_servers * m
  seq = _sequential_time(rows, num_stages, g, fabric)
  if num_stages == 0:
    return dict(seq, total=max(seq["balance"], seq["intra"]))
  due = balance_stages_from_rows(rows, num_servers, m)
  c_out = _scale_out_costs(rows, num_stages, g, fabric.scale_out)
  total, head = _duplex_time_at(np.zeros(1, np.int64), rows, due,
                                stage_loads(rows, num_stages, g), c_out, g,
                                fabric)
  return dict(seq, total=total, balance_exposed=head)


def fast_time(schedule: ref.Schedule, fabric: Fabric = Fabric(),
              pipeline_balance: bool | str = True, ports: str = "duplex",
              balance_timings=BALANCE_TIMINGS) -> dict:
  """``fast_time_from_rows`` of a reference Schedule."""
  return fast_time_from_rows(schedule_rows(schedule), schedule.num_bvn_stages,
                             schedule.num_servers, schedule.gpus_per_server,
                             fabric, pipeline_balance, ports, balance_timings)


def spreadout_time(traffic, num_servers: int, gpus_per_server: int,
                   fabric: Fabric = Fabric()) -> float:
  """GPU-level SpreadOut: stage i = 1..G-1, GPU g sends to (g + i) % G; a
  stage lasts as long as its slowest non-empty pair on its tier."""
  t = ref._check_traffic(traffic, num_servers, gpus_per_server).astype(float)
  g = t.shape[0]
  s = np.arange(g)
  total = 0.0
  for i in range(1, g):
    d = (s + i) % g
    x = t[s, d]
    same = (s // gpus_per_server) == (d // gpus_per_server)
    cost = np.where(same, fabric.scale_up.alpha_s + x / fabric.scale_up.bandwidth_Bps,
                    fabric.scale_out.alpha_s + x / fabric.scale_out.bandwidth_Bps)
    total += float(np.where(x > 0, cost, 0.0).max(initial=0.0))
  return total


def direct_time(traffic, num_servers: int, gpus_per_server: int,
                fabric: Fabric = Fabric(), incast_efficiency: float = 1.0
                ) -> float:
  """Direct all-to-all: every flow at once, fluid fair sharing.

  Each GPU's NIC carries its own inter-server traffic (no balancing); the
  time is the busiest NIC (send or receive) at ``incast_efficiency`` times
  the line rate, or the busiest scale-up port, whichever is longer.  With
  ``incast_efficiency = 1`` this is optimistic (real incast loses goodput).
  """
  if not 0 < incast_efficiency <= 1:
    raise ValueError(
        f"incast_efficiency must be in (0, 1], got {incast_efficiency}")
  t = ref._check_traffic(traffic, num_servers, gpus_per_server).astype(float)
  srv = np.arange(t.shape[0]) // gpus_per_server
  same = srv[:, None] == srv[None, :]
  inter = np.where(same, 0.0, t)
  intra = np.where(same, t, 0.0)
  np.fill_diagonal(intra, 0.0)
  out = fabric.scale_out
  t_out = _step_cost(Link(out.alpha_s, out.bandwidth_Bps * incast_efficiency),
                     inter.sum(1), inter.sum(0))
  t_up = _step_cost(fabric.scale_up, intra.sum(1), intra.sum(0))
  return max(t_out, t_up)


def executed_plan_time(plan, fabric: Fabric = Fabric()) -> dict:
  """Completion time (s) of an ``ExecutionPlan`` as it is issued.

  The staged all-to-all (``xla_ffi/fast/issue.h``: the CUDA custom call,
  and the callback path alike) issues the plan's phases one after another,
  each as one NCCL group; a phase ends when its last op has ended, and the
  next one starts then (modelled as a barrier over all GPUs).  Within a
  phase every op runs at once on its link: an op between two GPUs of one
  server uses the sender's scale-up send port and the receiver's scale-up
  receive port, an op between servers the sender's NIC send port and the
  receiver's NIC receive port (``B_up`` / ``B_out`` per GPU and direction,
  full duplex, as in ``DuplexPorts``).  So a phase costs ``max(alpha_up +
  U / B_up, alpha_out + N / B_out)``, with ``U`` (``N``) the busiest
  scale-up (NIC) port's bytes in the phase (a tier the phase does not use
  costs nothing), and the plan costs the sum over its phases.  Local
  copies (``src == dst``) use neither tier and are not charged.

  ``plan``: ``plan.ExecutionPlan`` or an object with its ``ops``,
  ``num_phases`` and ``gpus_per_server`` (``cpp.execution_plan``'s); its
  rows are bytes (the traffic it was planned from).

  Returns dict with ``total``, ``phases`` (float[P], each phase's cost),
  ``scale_up`` and ``scale_out`` (float[P], each tier's cost per phase).
  """
  ops = np.asarray(plan.ops, np.int64).reshape(-1, 11)
  m = int(plan.gpus_per_server)
  p = int(plan.num_phases)
  ops = ops[ops[:, 1] != ops[:, 2]]
  g = int(max(ops[:, 1].max(initial=-1), ops[:, 2].max(initial=-1)) + 1)
  same = ops[:, 1] // m == ops[:, 2] // m
  costs = {}
  for name, sel, link in (("scale_up", same, fabric.scale_up),
                          ("scale_out", ~same, fabric.scale_out)):
    o = ops[sel]
    sent = np.bincount(o[:, 0] * g + o[:, 1], o[:, 3], p * g).reshape(p, g)
    recv = np.bincount(o[:, 0] * g + o[:, 2], o[:, 3], p * g).reshape(p, g)
    peak = np.maximum(sent, recv).max(axis=1, initial=0) if g else np.zeros(p)
    costs[name] = np.where(peak > 0,
                           link.alpha_s + peak / link.bandwidth_Bps, 0.0)
  phases = np.maximum(costs["scale_up"], costs["scale_out"])
  return {"total": float(phases.sum()), "phases": phases, **costs}


# Kinds of NVLink ops of an execution plan (``executed_phase_breakdown``).
NVLINK_KINDS = ("balancing", "redistribution", "intra")


def executed_phase_breakdown(plan, fabric: Fabric = Fabric()) -> dict:
  """What each phase's NVLink part carries on its busiest port.

  Per phase of ``plan`` (as ``executed_plan_time`` times it): the busiest
  scale-up port (GPU and direction, the one that sets the phase's NVLink
  cost) and its bytes by kind of op: ``balancing`` (from the flow's
  source to another lane of its server), ``redistribution`` (from a lane
  that is not the source to the flow's destination) and ``intra`` (a flow
  within a server, source to destination); ``exposed``: how much longer
  the NVLink part lasts than the scale-out (``scale_up - scale_out`` when
  positive, seconds).

  Returns dict with ``gpu`` and ``recv`` (int[P], bool[P]: the port),
  ``bytes`` (float[P, 3], by ``NVLINK_KINDS``), ``exposed`` (float[P]) and
  ``executed_plan_time``'s entries.
  """
  ex = executed_plan_time(plan, fabric)
  ops = np.asarray(plan.ops, np.int64).reshape(-1, 11)
  m = int(plan.gpus_per_server)
  p = int(plan.num_phases)
  ops = ops[(ops[:, 1] != ops[:, 2]) & (ops[:, 1] // m == ops[:, 2] // m)]
  g = int(max(ops[:, 1].max(initial=-1), ops[:, 2].max(initial=-1)) + 1)
  kind = np.where(ops[:, 1] == ops[:, 8],
                  np.where(ops[:, 2] == ops[:, 9], 2, 0), 1)
  gpu = np.zeros(p, np.int64)
  recv = np.zeros(p, bool)
  by_kind = np.zeros((p, len(NVLINK_KINDS)))
  if g:
    sent = np.bincount(ops[:, 0] * g + ops[:, 1], ops[:, 3], p * g).reshape(p, g)
    got = np.bincount(ops[:, 0] * g + ops[:, 2], ops[:, 3], p * g).reshape(p, g)
    recv = got.max(axis=1) > sent.max(axis=1)
    gpu = np.where(recv, got.argmax(axis=1), sent.argmax(axis=1))
    port = np.where(recv[ops[:, 0]], ops[:, 2], ops[:, 1]) == gpu[ops[:, 0]]
    np.add.at(by_kind, (ops[port, 0], kind[port]), ops[port, 3])
  exposed = np.maximum(ex["scale_up"] - ex["scale_out"], 0.0)
  return dict(ex, gpu=gpu, recv=recv, bytes=by_kind, exposed=exposed)

"""Analytical two-tier (scale-up / scale-out) completion-time model.

Like the FAST paper's simulator (NSDI '26, section 5.4, which follows TACCL
and TE-CCL), a schedule is a sequence of steps and each step costs a fixed
link wake-up delay ``alpha`` plus ``bytes / bandwidth`` of its busiest port.
Every GPU has one scale-up port and one scale-out NIC, each full duplex; a
step's cost on a tier is ``alpha + max over GPUs of max(sent, received) /
bandwidth`` (zero when the step moves nothing on that tier).

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


def fast_time_from_rows(rows, num_stages: int, num_servers: int,
                        gpus_per_server: int, fabric: Fabric = Fabric()
                        ) -> dict:
  """Completion time of a FAST schedule under the paper's pipeline (Fig. 11).

  Balancing first; scale-out stages back to back after it; the intra-server
  part starts with the first scale-out stage; redistribution of stage k
  starts when stage k's scale-out and the previous scale-up work are done
  (scale-up work is serialised, scale-out overlaps it).  Returns dict with
  ``total``, ``balance``, ``intra``, ``scale_out`` (sum of stage costs) and
  ``redistribute`` (sum), in seconds.
  """
  g = num_servers * gpus_per_server
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
  return {"total": max(out_end, up_free), "balance": t_bal, "intra": t_intra,
          "scale_out": so, "redistribute": red}


def fast_time(schedule: ref.Schedule, fabric: Fabric = Fabric()) -> dict:
  """``fast_time_from_rows`` of a reference Schedule."""
  return fast_time_from_rows(schedule_rows(schedule), schedule.num_bvn_stages,
                             schedule.num_servers, schedule.gpus_per_server,
                             fabric)


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

"""The analytical two-tier simulator (moe_jax.fast.simulator)."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from moe_jax.fast import cpp
from moe_jax.fast import reference as ref
from moe_jax.fast import simulator as sim
from moe_jax.fast import workloads

IDEAL = sim.Fabric(scale_up=sim.Link(0.0, 1e30), scale_out=sim.Link(0.0, 50e9))


@st.composite
def cases(draw):
  n = draw(st.integers(1, 6))
  m = draw(st.integers(1, 8))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  if draw(st.booleans()):
    t = workloads.uniform_matrix(rng, n * m, mean=1e6)
  else:
    t = workloads.zipf_matrix(rng, n * m, draw(st.floats(0.4, 0.9)), mean=1e6)
  return t, n, m


@given(cases())
def test_fast_meets_bound_with_ideal_scale_up(case):
  t, n, m = case
  t = t * m  # every BvN weight a multiple of M: no rounding across GPUs
  s = ref.fast_schedule(t, n, m)
  got = sim.fast_time(s, IDEAL)["total"]
  assert got == pytest.approx(sim.bound_time(t, n, m, IDEAL), rel=1e-9,
                              abs=1e-15)


@given(cases())
def test_no_schedule_beats_the_bound(case):
  t, n, m = case
  for fabric in (sim.Fabric(), sim.Fabric(sim.NVLINK_H100, sim.ETH_400G)):
    b = sim.bound_time(t, n, m, fabric)
    fast = sim.fast_time(ref.fast_schedule(t, n, m), fabric)
    assert fast["total"] >= b * (1 - 1e-12)
    assert fast["scale_out"] >= b * (1 - 1e-12)
    assert sim.spreadout_time(t, n, m, fabric) >= b * (1 - 1e-12)
    assert sim.direct_time(t, n, m, fabric) >= b * (1 - 1e-12)


@pytest.mark.skipif(not cpp.available(), reason="moe_jax._fast not built")
def test_cpp_rows_give_same_time():
  rng = np.random.default_rng(3)
  t = workloads.zipf_matrix(rng, 48, 0.9, mean=1e6)
  d = cpp.schedule_arrays(t, 6, 8)
  rows = np.concatenate([d["transfers"], d["redistribution"]])
  for pipelined in (True, False):
    a = sim.fast_time_from_rows(rows, d["weights"].shape[0], 6, 8,
                                pipeline_balance=pipelined)
    b = sim.fast_time(ref.fast_schedule(t, 6, 8), pipeline_balance=pipelined)
    for key in ("total", "balance", "balance_exposed", "intra", "scale_out",
                "redistribute"):
      assert a[key] == pytest.approx(b[key])


def test_spreadout_hand_example():
  # 2 servers x 1 GPU, 100 MB each way over 50 GB/s with 5 us wake-up.
  t = np.array([[0, 100_000_000], [50_000_000, 0]])
  f = sim.Fabric(sim.NVLINK_H200, sim.IB_400G)
  assert sim.spreadout_time(t, 2, 1, f) == pytest.approx(5e-6 + 2e-3)
  assert sim.bound_time(t, 2, 1, f) == pytest.approx(2e-3)
  assert sim.direct_time(t, 2, 1, f) == pytest.approx(5e-6 + 2e-3)


def test_bad_arguments():
  with pytest.raises(ValueError, match="bandwidth_Bps"):
    sim.Link(1e-6, 0)
  with pytest.raises(ValueError, match="alpha_s"):
    sim.Link(-1, 1e9)
  with pytest.raises(ValueError, match="incast_efficiency"):
    sim.direct_time(np.zeros((2, 2), int), 2, 1, incast_efficiency=0)

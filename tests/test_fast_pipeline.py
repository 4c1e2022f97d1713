"""Pipelined balancing: per-stage balancing of the FAST schedule and the
simulator's pipelined completion time."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moe_jax.fast import cpp
from moe_jax.fast import reference as ref
from moe_jax.fast import simulator as sim
from moe_jax.fast import workloads
from fast_testing import traffic_cases

FABRICS = (sim.Fabric(), sim.Fabric(sim.NVLINK_H100, sim.ETH_400G),
           sim.Fabric(sim.Link(2e-6, 100e9), sim.IB_400G))


def _key(transfers):
  return sorted((t.src_gpu, t.dst_gpu, t.amount, t.flow) for t in transfers)


@given(traffic_cases())
def test_per_stage_balancing_is_the_balancing_phase(case):
  t, n, m = case
  s = ref.fast_schedule(t, n, m)
  parts = ref.balance_by_stage(s)
  assert len(parts) == s.num_bvn_stages
  whole = s.stages[0].transfers
  assert _key([tr for p in parts for tr in p]) == _key(whole)


@given(traffic_cases())
def test_balancing_precedes_its_pair_first_stage(case):
  t, n, m = case
  s = ref.fast_schedule(t, n, m)
  first = ref.first_stages(s.matchings, s.real, n)
  for k, part in enumerate(ref.balance_by_stage(s)):
    for tr in part:
      a, b = tr.src_gpu // m, tr.flow[1] // m
      assert first[a, b] == k
      # No scale-out before stage k carries the pair.
      for j in range(k):
        assert not (s.matchings[j, a] == b and s.real[j, a] > 0)
  rows = sim.schedule_rows(s)
  np.testing.assert_array_equal(sim.first_stages_from_rows(rows, n, m), first)


def draw_order_and_starts(data, k):
  """A stage order (a permutation of range(k)) and chunk starts (0 first)."""
  order = data.draw(st.permutations(range(k)))
  cuts = data.draw(st.sets(st.integers(1, max(1, k - 1)), max_size=4))
  return order, [0] + sorted(c for c in cuts if c < k)


@given(traffic_cases(), st.data())
def test_pipelined_orders_deliver_exactly(case, data):
  t, n, m = case
  s = ref.fast_schedule(t, n, m)
  order, starts = draw_order_and_starts(data, s.num_bvn_stages)
  stages = ref.pipelined_stages(s, starts, order)
  assert ref.delivered_exactly(t, stages)


@settings(max_examples=40, deadline=None)
@given(traffic_cases())
def test_pipelined_time_between_bound_and_sequential(case):
  t, n, m = case
  t = t * 1000  # bytes, so alphas do not dominate
  s = ref.fast_schedule(t, n, m)
  for fabric, ports in itertools.product(FABRICS, sim.PORT_MODELS):
    seq = sim.fast_time(s, fabric, pipeline_balance=False, ports=ports)
    pipe = sim.fast_time(s, fabric, ports=ports)
    bound = sim.bound_time(t, n, m, fabric)
    assert pipe["total"] <= seq["total"] * (1 + 1e-12)
    assert pipe["total"] >= bound * (1 - 1e-12)
    assert pipe["balance_exposed"] <= seq["balance_exposed"] * (1 + 1e-12)
    win = sim.fast_time(s, fabric, pipeline_balance="windows")
    assert win["total"] >= bound * (1 - 1e-12)


@given(traffic_cases())
def test_reordered_rows_are_a_valid_schedule(case):
  t, n, m = case
  s = ref.fast_schedule(t, n, m)
  rows = sim.schedule_rows(s)
  order = sim.light_balance_first_order(rows, s.num_bvn_stages, n, m,
                                        sim.NVLINK_H200)
  assert sorted(order.tolist()) == list(range(s.num_bvn_stages))
  stages = ref.pipelined_stages(s, (0,), order)
  assert ref.delivered_exactly(t, stages)
  moved = sim.reorder_stages(rows, order)
  again = [tr for st_ in stages for tr in st_.transfers]
  assert sorted(map(tuple, moved[:, 1:].tolist())) == sorted(
      (tr.src_gpu, tr.dst_gpu, tr.amount, *tr.flow) for tr in again)


def test_one_chunk_is_the_sequential_model():
  rng = np.random.default_rng(5)
  t = workloads.zipf_matrix(rng, 32, 0.9, mean=1e6)
  rows = sim.schedule_rows(ref.fast_schedule(t, 4, 8))
  s = int(rows[:, 0].max() - 2) // 2 + 1
  seq = sim.fast_time_from_rows(rows, s, 4, 8, pipeline_balance=False,
                                ports="shared")
  due = sim.balance_stages_from_rows(rows, 4, 8)
  c_out = sim._scale_out_costs(rows, s, 32, sim.IB_400G)
  sent, recv = sim.stage_loads(rows, s, 32)
  c_red = [sim._step_cost(sim.NVLINK_H200, sent[3 + 2 * k], recv[3 + 2 * k])
           for k in range(s)]
  total, head = sim._chunked_time_at(np.zeros(1, np.int64), rows, due, c_out,
                                     c_red, seq["intra"], 32, sim.NVLINK_H200)
  assert total == pytest.approx(seq["total"])
  assert head == pytest.approx(seq["balance"])
  duplex = sim.fast_time_from_rows(rows, s, 4, 8, pipeline_balance=False)
  total, head = sim._duplex_time_at(np.zeros(1, np.int64), rows, due,
                                    (sent, recv), c_out, 32, sim.Fabric())
  assert total == pytest.approx(duplex["total"])
  assert head == pytest.approx(seq["balance"])


@pytest.mark.skipif(not cpp.available(), reason="moe_jax._fast not built")
def test_cpp_rows_give_same_pipelined_time():
  rng = np.random.default_rng(7)
  t = workloads.zipf_matrix(rng, 48, 0.9, mean=1e6)
  d = cpp.schedule_arrays(t, 6, 8)
  rows = np.concatenate([d["transfers"], d["redistribution"]])
  a = sim.fast_time_from_rows(rows, d["weights"].shape[0], 6, 8)
  b = sim.fast_time(ref.fast_schedule(t, 6, 8))
  assert a["total"] == pytest.approx(b["total"])
  assert a["balance_starts"] == b["balance_starts"]
  np.testing.assert_array_equal(
      sim.balance_stages_from_rows(rows, 6, 8)[rows[:, 0] == 0],
      sim.balance_stages_from_rows(sim.schedule_rows(ref.fast_schedule(
          t, 6, 8)), 6, 8)[sim.schedule_rows(ref.fast_schedule(t, 6, 8))[:, 0]
                           == 0])


def _summed(transfers):
  out = {}
  for t in transfers:
    key = (t.src_gpu, t.dst_gpu, t.flow)
    out[key] = out.get(key, 0) + t.amount
  return out


@given(traffic_cases())
def test_balancing_by_use_adds_up_to_the_balancing_phase(case):
  t, n, m = case
  s = ref.fast_schedule(t, n, m)
  parts = ref.balance_by_use(s)
  assert len(parts) == s.num_bvn_stages
  assert _summed([tr for p in parts for tr in p]) == _summed(
      s.stages[0].transfers)
  # Rows: the same transfers, each due before the stage that sends them.
  rows, due = sim.balance_rows_by_use(sim.schedule_rows(s))
  bal = rows[rows[:, 0] == 0]
  want = sorted((k, tr.src_gpu, tr.dst_gpu, tr.amount, *tr.flow)
                for k, p in enumerate(parts) for tr in p)
  got = sorted(map(tuple, np.column_stack([due[rows[:, 0] == 0],
                                           bal[:, 1:]]).tolist()))
  assert got == want


@given(traffic_cases(), st.data())
def test_balancing_by_use_delivers_exactly_in_any_order(case, data):
  t, n, m = case
  s = ref.fast_schedule(t, n, m)
  k = s.num_bvn_stages
  order, starts = draw_order_and_starts(data, k)
  if data.draw(st.booleans()):
    starts = list(range(k)) or [0]
  stages = ref.pipelined_stages(s, starts, order, timing="use")
  assert ref.delivered_exactly(t, stages)


@given(traffic_cases())
def test_ends_light_order_is_a_permutation_with_light_first_stage(case):
  t, n, m = case
  s = ref.fast_schedule(t, n, m)
  rows = sim.schedule_rows(s)
  order = sim.ends_light_order(rows, s.num_bvn_stages, n * m)
  assert sorted(order.tolist()) == list(range(s.num_bvn_stages))
  assert ref.delivered_exactly(
      t, ref.pipelined_stages(s, (0,), order, timing="use"))


def test_pipelined_zipf_meets_eight_percent_of_the_bound():
  rng = np.random.default_rng(11)
  t = workloads.zipf_matrix(rng, 64, 0.9, mean=50e6)
  d = cpp.schedule_arrays(t, 8, 8) if cpp.available() else None
  s = ref.fast_schedule(t, 8, 8)
  r = sim.fast_time(s)
  assert r["total"] <= 1.08 * sim.bound_time(t, 8, 8)
  assert r["balance_timing"] in sim.BALANCE_TIMINGS
  if d is not None:
    rows = np.concatenate([d["transfers"], d["redistribution"]])
    assert sim.fast_time_from_rows(rows, s.num_bvn_stages, 8, 8)[
        "total"] == pytest.approx(r["total"])


def test_pipelined_stages_rejects_unknown_timing():
  s = ref.fast_schedule(np.ones((4, 4), np.int64), 2, 2)
  with pytest.raises(ValueError, match="timing"):
    ref.pipelined_stages(s, (0,), timing="late")

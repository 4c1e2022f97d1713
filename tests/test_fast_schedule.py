"""Properties of the pure-Python FAST scheduler (moe_jax.fast.reference)."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from moe_jax.fast import reference as ref
from fast_testing import traffic_cases


def _check(t, n, m):
  s = ref.fast_schedule(t, n, m)
  # Every unit of every flow arrives exactly once at its destination GPU.
  assert ref.delivered_exactly(t, s.stages)
  # Padded matrix: equal sums, dominates D; decomposition reconstructs it.
  p = s.padded_matrix
  assert (p >= s.server_matrix).all()
  assert set(p.sum(0)) | set(p.sum(1)) <= {s.bound}
  recon = np.zeros_like(p)
  for perm, w in zip(s.matchings, s.weights):
    assert sorted(perm.tolist()) == list(range(n))
    assert w > 0
    recon[np.arange(n), perm] += w
  np.testing.assert_array_equal(recon, p)
  # Stage count bound and optimal server-level time.
  assert s.num_bvn_stages <= n * n - 2 * n + 4  # the second in 3 parts
  assert int(s.server_stage_times().sum()) == s.bound
  assert s.bound == ref.lower_bounds(t, n, m)["server"]
  # Scale-out is one-to-one, peer-to-peer, and each GPU carries its share
  # (w // M or w // M + 1 units) of every stage.
  for stage in s.stages:
    if stage.kind == "scale_out":
      per_gpu = {}
      for tr in stage.transfers:
        assert tr.src_gpu % m == tr.dst_gpu % m
        assert tr.src_gpu // m != tr.dst_gpu // m
        assert s.matchings[stage.bvn_index, tr.src_gpu // m] == tr.dst_gpu // m
        per_gpu[tr.src_gpu] = per_gpu.get(tr.src_gpu, 0) + tr.amount
      w = int(s.weights[stage.bvn_index])
      assert all(v <= -(-w // m) for v in per_gpu.values())
    elif stage.kind in ("balance", "redistribute", "intra"):
      for tr in stage.transfers:
        assert tr.src_gpu // m == tr.dst_gpu // m
  return s


@given(traffic_cases())
def test_fast_schedule_properties(case):
  _check(*case)


@given(traffic_cases())
def test_balancing_equalises_per_gpu_volume(case):
  t, n, m = case
  s = ref.fast_schedule(t, n, m)
  sent = np.zeros((n * m, n), np.int64)  # GPU -> destination server volume
  for stage in s.stages:
    if stage.kind == "scale_out":
      for tr in stage.transfers:
        sent[tr.src_gpu, tr.dst_gpu // m] += tr.amount
  for a in range(n):
    for b in range(n):
      if a != b:
        col = sent[a * m:(a + 1) * m, b]
        assert col.sum() == s.server_matrix[a, b]
        assert col.max() - col.min() <= 1


@given(traffic_cases())
def test_spreadout_delivers_and_is_no_faster_than_bound(case):
  t, n, m = case
  stages = ref.spreadout_schedule(t)
  assert ref.delivered_exactly(t, stages)
  d = ref.server_matrix(t, n, m)
  assert ref.spreadout_time(d) >= ref.lower_bounds(t, n, m)["server"]
  expected = sum(max((tr.amount for tr in st_.transfers), default=0)
                 for st_ in stages)
  assert ref.spreadout_time(t) == expected


def test_spreadout_misses_bound_fast_hits_it():
  # A 4-server matrix (like the paper's Fig. 9) where SpreadOut takes 17
  # units and the bound (column 3) is 14.
  d = np.array([[0, 3, 5, 6], [0, 0, 5, 6], [1, 2, 0, 2], [1, 5, 1, 0]])
  t = d  # one GPU per server
  s = ref.fast_schedule(t, 4, 1)
  assert ref.delivered_exactly(t, s.stages)
  assert int(s.server_stage_times().sum()) == s.bound == 14
  assert ref.spreadout_time(d) == 17


def test_delivery_check_catches_errors():
  t = np.array([[0, 2], [3, 0]])
  stages = ref.spreadout_schedule(t)
  stages[0].transfers[0] = ref.Transfer(0, 1, 1, (0, 1))
  assert not ref.delivered_exactly(t, stages)
  with pytest.raises(ValueError, match="did not hold"):
    ref.simulate_delivery(t, [ref.Stage("x", [ref.Transfer(1, 0, 5, (1, 0))])])


def test_bad_arguments():
  with pytest.raises(ValueError, match="traffic must have shape"):
    ref.fast_schedule(np.zeros((3, 3), int), 2, 2)
  with pytest.raises(ValueError, match="non-negative"):
    ref.fast_schedule(-np.ones((2, 2), int), 1, 2)
  with pytest.raises(ValueError, match="num_servers"):
    ref.fast_schedule(np.zeros((0, 0), int), 0, 2)
  with pytest.raises(ValueError, match="gpus_per_server"):
    ref.fast_schedule(np.zeros((2, 2), int), 2, 0)


def test_empty_and_zero_traffic():
  s = ref.fast_schedule(np.zeros((6, 6), int), 3, 2)
  assert s.num_bvn_stages == 0 and s.bound == 0
  assert ref.delivered_exactly(np.zeros((6, 6), int), s.stages)


@given(traffic_cases())
def test_bottleneck_servers_busy_in_every_stage(case):
  t, n, m = case
  s = ref.fast_schedule(t, n, m)
  d = s.server_matrix
  recv_real = np.zeros((s.num_bvn_stages, n), np.int64)
  for k in range(s.num_bvn_stages):
    recv_real[k, s.matchings[k]] = s.real[k]
  for a in range(n):
    if d[a].sum() == s.bound and s.bound > 0:  # bottleneck sender
      np.testing.assert_array_equal(s.real[:, a], s.weights)
    if d[:, a].sum() == s.bound and s.bound > 0:  # bottleneck receiver
      np.testing.assert_array_equal(recv_real[:, a], s.weights)


@given(st.integers(2, 6), st.integers(0, 2**31 - 1))
def test_balanced_server_matrix_needs_no_padding(n, seed):
  # A sum of shifted permutations: every server sends and receives the same,
  # so no padding, and the schedule takes exactly the common row sum.
  rng = np.random.default_rng(seed)
  w = rng.integers(1, 50, n - 1)
  d = np.zeros((n, n), np.int64)
  for i, x in enumerate(w, start=1):
    d[np.arange(n), (np.arange(n) + i) % n] = x
  s = ref.fast_schedule(d, n, 1)
  np.testing.assert_array_equal(s.padded_matrix, d)
  assert s.num_bvn_stages <= n * n - 2 * n + 4  # the second in 3 parts
  assert int(s.server_stage_times().sum()) == s.bound == int(w.sum())


@given(st.integers(0, 10**12), st.integers(1, 8))
def test_second_stage_runs_in_growing_parts(w, m):
  mats = np.asarray([[1, 0], [0, 1], [1, 0]])
  ws = np.asarray([5, w, 7], np.int64)
  got_m, got_w = ref.split_second_stage(mats, ws, m)
  parts = got_w[1:-1]
  assert int(parts.sum()) == w and (parts > 0).all()
  assert got_w[0] == 5 and got_w[-1] == 7
  assert (got_m[1:-1] == mats[1]).all()
  # Cuts at 10 / 40 and 23 / 40 of the weight, rounded down to multiples
  # of M.
  cuts = {w * x // 40 - w * x // 40 % m for x in ref.SPLIT_CUM[:-1]}
  assert np.cumsum(parts)[:-1].tolist() == sorted(cuts - {0, w})

"""The C++ FAST scheduler (moe_jax._fast) against the Python reference."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from moe_jax.fast import cpp
from moe_jax.fast import reference as ref
from moe_jax.fast import workloads
from fast_testing import traffic_cases

pytestmark = pytest.mark.skipif(not cpp.available(),
                                reason="moe_jax._fast not built")


def _same(a: ref.Schedule, b: ref.Schedule):
  np.testing.assert_array_equal(a.server_matrix, b.server_matrix)
  np.testing.assert_array_equal(a.padded_matrix, b.padded_matrix)
  np.testing.assert_array_equal(a.matchings, b.matchings)
  np.testing.assert_array_equal(a.weights, b.weights)
  np.testing.assert_array_equal(a.real, b.real)
  assert a.bound == b.bound
  assert [(s.kind, s.bvn_index) for s in a.stages] == [
      (s.kind, s.bvn_index) for s in b.stages]
  for sa, sb in zip(a.stages, b.stages):
    assert sa.transfers == sb.transfers, sa.kind


@given(traffic_cases())
def test_cpp_matches_reference(case):
  t, n, m = case
  a = ref.fast_schedule(t, n, m)
  b = cpp.fast_schedule(t, n, m)
  _same(a, b)
  assert ref.delivered_exactly(t, b.stages)
  assert int(b.server_stage_times().sum()) == b.bound


@given(traffic_cases())
def test_cpp_server_only_matches(case):
  t, n, m = case
  full = cpp.schedule_arrays(t, n, m, with_transfers=True)
  lite = cpp.schedule_arrays(t, n, m, with_transfers=False)
  for key in ("matchings", "weights", "real", "padded_matrix"):
    np.testing.assert_array_equal(full[key], lite[key])
  assert lite["transfers"].shape == (0, 6)
  assert cpp.spreadout_time(ref.server_matrix(t, n, m)) == ref.spreadout_time(
      ref.server_matrix(t, n, m))


def test_cpp_reuses_buffers_across_sizes():
  rng = np.random.default_rng(0)
  for n, m in [(4, 8), (2, 3), (6, 8), (1, 1), (4, 8)]:
    t = workloads.zipf_matrix(rng, n * m, 0.9, mean=200)
    _same(ref.fast_schedule(t, n, m), cpp.fast_schedule(t, n, m))
  ns = cpp.time_schedule(t, 4, 8, repeats=3)
  assert ns.shape == (3,) and (ns > 0).all()
  mats = [workloads.uniform_matrix(rng, 32, 100) for _ in range(3)]
  for buffers in ("warm", "cold", "new"):
    ns = cpp.time_schedule_each(mats, 4, 8, buffers=buffers)
    assert ns.shape == (3,) and (ns > 0).all()
  with pytest.raises(ValueError, match="buffers"):
    cpp.time_schedule_each(mats, 4, 8, buffers="hot")


def test_cpp_large_delivery():
  # 16 servers x 8 GPUs: delivery and optimality at a size the property
  # tests don't reach.
  rng = np.random.default_rng(1)
  t = workloads.zipf_matrix(rng, 128, 0.9, mean=100)
  s = cpp.fast_schedule(t, 16, 8)
  assert ref.delivered_exactly(t, s.stages)
  assert int(s.server_stage_times().sum()) == s.bound
  assert s.num_bvn_stages <= 16 * 16 - 2 * 16 + 2


def test_cpp_bad_arguments():
  with pytest.raises(ValueError, match="traffic must have shape"):
    cpp.fast_schedule(np.zeros((3, 3), np.int64), 2, 2)
  with pytest.raises(ValueError, match="non-negative"):
    cpp.fast_schedule(-np.ones((2, 2), np.int64), 1, 2)
  with pytest.raises(ValueError, match="square"):
    cpp.spreadout_time(np.zeros((2, 3), np.int64))


def _assert_gpu_rows(t, n, m, gpu, full):
  one = cpp.schedule_arrays(t, n, m, gpu=gpu)
  for key in ("transfers", "redistribution"):
    f = full[key]
    np.testing.assert_array_equal(one[key],
                                  f[(f[:, 1] == gpu) | (f[:, 2] == gpu)])
  np.testing.assert_array_equal(one["matchings"], full["matchings"])


@given(traffic_cases(), st.integers(0, 63))
def test_cpp_per_gpu_rows_are_the_full_rows_of_that_gpu(case, pick):
  t, n, m = case
  _assert_gpu_rows(t, n, m, pick % (n * m), cpp.schedule_arrays(t, n, m))
  with pytest.raises(ValueError, match="gpu must be"):
    cpp.schedule_arrays(t, n, m, gpu=n * m)


def _hot_sender_and_receiver(rng, g):
  # One GPU sends far more than its share to every server (its tail, with
  # its flow into every GPU, is split over many receiving lanes) and one
  # GPU receives far more than the others (its flows lie in many tails).
  t = rng.integers(0, 5, (g, g))
  t[rng.integers(g), :] += 500
  t[:, rng.integers(g)] += 300
  return t


@pytest.mark.parametrize("n, m", [(2, 8), (3, 3), (4, 8), (5, 2), (3, 1)])
def test_cpp_per_gpu_rows_for_every_gpu(n, m):
  # The per-GPU schedule locates the GPU's part of each pair's balancing
  # from sums instead of building every lane: check every GPU, not one.
  rng = np.random.default_rng(10 * n + m)
  g = n * m
  for t in (workloads.uniform_matrix(rng, g, 50),
            workloads.zipf_matrix(rng, g, 0.9, 200),
            _hot_sender_and_receiver(rng, g)):
    t = t.astype(np.int64)
    full = cpp.schedule_arrays(t, n, m)
    for gpu in range(g):
      _assert_gpu_rows(t, n, m, gpu, full)


@given(traffic_cases())
def test_cpp_ranges_form_decodes_to_the_rows(case):
  # The ranges form (what `full` times) holds the whole schedule: decoded
  # in Python from its arrays and the traffic alone, it gives the rows.
  t, n, m = case
  full = cpp.schedule_arrays(t, n, m)
  d = cpp.schedule_arrays(t, n, m, ranges=True)
  for key in ("matchings", "weights", "real", "server_matrix"):
    np.testing.assert_array_equal(d[key], full[key])
  transfers, redistribution = cpp.rows_from_ranges(t, d)
  np.testing.assert_array_equal(transfers, full["transfers"])
  np.testing.assert_array_equal(redistribution, full["redistribution"])
  # Every GPU's workspace use from the ranges, as the fallback below the
  # workspace bound computes it, equals the whole plan's.
  np.testing.assert_array_equal(cpp.workspace_use(t, n, m),
                                cpp.execution_plan(t, n, m).workspace_used)
  ns = cpp.time_schedule(t, n, m, repeats=2, ranges=True)
  assert ns.shape == (2,)
  with pytest.raises(ValueError, match="ranges needs"):
    cpp.schedule_arrays(t, n, m, gpu=0, ranges=True)

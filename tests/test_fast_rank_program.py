"""One rank's program built from its per-GPU schedule alone
(xla_ffi/fast/plan.h's RankPlanner, what the CUDA custom call runs) equals
that rank's part of the whole plan, op for op and field for field."""

import numpy as np
import pytest
from hypothesis import given, settings

from moe_jax.fast import cpp
from moe_jax.fast import plan as pl
from moe_jax.fast import workloads
from fast_testing import expected_out, rank_program_cases, traffic_cases

pytestmark = pytest.mark.skipif(not cpp.available(),
                                reason="moe_jax._fast not built")


def _assert_same_programs(t, n, m):
  for rank in range(n * m):
    mine = cpp.rank_program(t, n, m, rank, per_rank=True)
    whole = cpp.rank_program(t, n, m, rank, per_rank=False)
    assert mine.keys() == whole.keys()
    for key in mine:
      np.testing.assert_array_equal(mine[key], whole[key],
                                    err_msg=f"{n}x{m} rank {rank}: {key}")
      assert np.asarray(mine[key]).dtype == np.asarray(whole[key]).dtype


@given(rank_program_cases())
def test_per_rank_program_is_the_ranks_part_of_the_whole_plan(case):
  _assert_same_programs(*case)


@pytest.mark.parametrize("n, m", [(1, 1), (1, 8), (6, 1), (2, 8), (3, 3),
                                  (4, 8), (6, 8)])
def test_per_rank_programs_on_benchmark_matrices(n, m):
  rng = np.random.default_rng(7 * n + m)
  g = n * m
  for t in (workloads.uniform_matrix(rng, g, 1000),
            workloads.zipf_matrix(rng, g, 0.9, 1000),
            workloads.zipf_matrix(rng, g, 0.9, 1000, scope="row")):
    _assert_same_programs(t.astype(np.int64), n, m)


def test_program_fields():
  rng = np.random.default_rng(1)
  t = workloads.zipf_matrix(rng, 8, 0.9, mean=40)
  plan = cpp.execution_plan(t, 2, 4)
  for rank in range(8):
    prog = cpp.rank_program(t, 2, 4, rank)
    ops, begin = prog["ops"], prog["phase_begin"]
    kind, peer = ops[:, 0], ops[:, 1]
    # Every op of the rank's part of the plan, and only those.
    mine = plan.ops[(plan.ops[:, pl.SRC] == rank) | (plan.ops[:, pl.DST] == rank)]
    assert len(ops) == len(mine)
    assert begin[0] == 0 and begin[-1] == len(ops) and (np.diff(begin) >= 0).all()
    # Phases: 0 .. S + 1 for S BvN stages, whatever the rank's share of them.
    s = cpp.schedule_arrays(t, 2, 4)["weights"].shape[0]
    assert len(begin) == s + 3
    assert ((kind == 0) == (peer == rank)).all()
    assert (ops[kind == 1, 5:] == -1).all()   # a send's receiving side
    assert (ops[kind == 2, 3:5] == -1).all()  # a receive's sending side
    assert prog["recv_total"] == t[:, rank].sum()
    assert prog["workspace_used"] == plan.workspace_used[rank]


def test_simulation_with_a_workspace_below_the_bound():
  # Below the proven bound every rank sums every GPU's workspace use from
  # the full schedule, so a workspace that fits the plan works and one row
  # less fails everywhere.
  rng = np.random.default_rng(2)
  t = workloads.zipf_matrix(rng, 8, 0.9, mean=20)
  rows_in, rows_out = int(t.sum(1).max()), int(t.sum(0).max())
  need = int(cpp.execution_plan(t, 2, 4).workspace_used.max())
  assert 0 < need < pl.workspace_rows(rows_in, rows_out, 2, 4)
  x = rng.integers(0, 256, (8, rows_in, 3), dtype=np.uint8)
  out = cpp.simulate_execution(t, 2, 4, x, rows_out, need)
  np.testing.assert_array_equal(out, expected_out(t, x, rows_out))
  with pytest.raises(ValueError, match="workspace rows"):
    cpp.simulate_execution(t, 2, 4, x, rows_out, need - 1)
  ns = cpp.time_rank_program(t, 2, 4, 1, repeats=2, below_bound=True)
  assert ns.shape == (2,) and (ns > 0).all()


@given(traffic_cases())
@settings(deadline=None)
def test_workspace_check_below_the_bound_matches_the_plan(case):
  # The workspace the whole plan uses on its busiest GPU is exactly what
  # the check below the bound requires: it passes, one row less fails
  # with the error naming that GPU's need.
  t, n, m = case
  need = int(cpp.execution_plan(t, n, m).workspace_used.max(initial=0))
  rows_in = max(int(t.sum(1).max()), 1)
  rows_out = max(int(t.sum(0).max()), 1)
  if need == 0 or need >= pl.workspace_rows(rows_in, rows_out, n, m):
    return
  x = np.zeros((n * m, rows_in, 1), np.uint8)
  cpp.simulate_execution(t, n, m, x, rows_out, need)
  with pytest.raises(ValueError, match=f"needs {need} workspace rows"):
    cpp.simulate_execution(t, n, m, x, rows_out, need - 1)


def test_rank_out_of_range():
  t = np.ones((4, 4), np.int64)
  for per_rank in (True, False):
    with pytest.raises(ValueError, match="out of range"):
      cpp.rank_program(t, 2, 2, 4, per_rank=per_rank)
  ns = cpp.time_rank_program(t, 2, 2, 3, repeats=2)
  assert ns.shape == (2,) and (ns > 0).all()

"""Execution plans of FAST schedules: every row moves once, to its place.

The Python planner (moe_jax.fast.plan) is checked op by op; the C++ one
(moe_jax._fast.plan) must produce the same ops; the C++ simulation runs
every rank's program through issue.h (the code the CUDA custom call uses)
over an in-memory NCCL stand-in and must deliver the reference's bytes.
"""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from moe_jax.fast import cpp
from moe_jax.fast import phases as ph
from moe_jax.fast import plan as pl
from moe_jax.fast import reference as ref
from moe_jax.fast import workloads
from fast_testing import buffer_cases, expected_out, traffic_cases

needs_cpp = pytest.mark.skipif(not cpp.available(), reason="moe_jax._fast not built")


def _run_ops(plan, traffic, x, rows_out, ws_rows):
  """Executes the ops phase by phase on numpy buffers (reads at phase start)."""
  g = x.shape[0]
  out = np.full((g, rows_out) + x.shape[2:], 0x5A, x.dtype)
  ws = np.full((g, ws_rows) + x.shape[2:], 0x5A, x.dtype)
  for d in range(g):
    out[d, int(traffic[:, d].sum()):] = 0
  for p in range(plan.num_phases):
    ops = plan.ops[plan.ops[:, pl.PHASE] == p]
    reads = [(x if op[pl.SRC_BUF] == pl.X else ws)[
        op[pl.SRC], op[pl.SRC_ROW]:op[pl.SRC_ROW] + op[pl.ROWS]].copy() for op in ops]
    for op, rows in zip(ops, reads):
      dst = out if op[pl.DST_BUF] == pl.OUT else ws
      dst[op[pl.DST], op[pl.DST_ROW]:op[pl.DST_ROW] + op[pl.ROWS]] = rows
  return out


@given(buffer_cases())
def test_plan_delivers_every_row_once(case):
  t, n, m, rows_in, rows_out = case
  plan = pl.execution_plan(t, n, m)
  ws_rows = pl.workspace_rows(rows_in, rows_out, n, m)
  assert (plan.workspace_used <= ws_rows).all()
  assert plan.num_phases <= pl.max_phases(n)
  assert (np.diff(plan.ops[:, pl.PHASE]) >= 0).all()
  pl.check_plan(plan, t, rows_in, rows_out, ws_rows)
  rng = np.random.default_rng(int(t.sum()))
  x = rng.integers(0, 2**16, (n * m, rows_in, 3), dtype=np.uint16)
  np.testing.assert_array_equal(_run_ops(plan, t, x, rows_out, ws_rows),
                                expected_out(t, x, rows_out))


@given(traffic_cases())
def test_plan_ops_follow_the_schedule(case):
  t, n, m = case
  plan = pl.execution_plan(t, n, m)
  ops = plan.ops
  # Local rows are copied in phase 0, never sent; everything else crosses
  # GPUs; the rows per flow reaching out add up to the traffic.
  local = ops[ops[:, pl.SRC] == ops[:, pl.DST]]
  assert (local[:, pl.PHASE] == 0).all()
  assert (local[:, pl.FLOW_SRC] == local[:, pl.FLOW_DST]).all()
  final = ops[ops[:, pl.DST_BUF] == pl.OUT]
  got = np.zeros_like(t)
  np.add.at(got, (final[:, pl.FLOW_SRC], final[:, pl.FLOW_DST]), final[:, pl.ROWS])
  np.testing.assert_array_equal(got, t)
  # Only relayed rows touch the workspace; a GPU on another server than the
  # flow's source only ever gets rows of the flow from its own server peer.
  srv = np.arange(n * m) // m
  relayed = ops[ops[:, pl.DST_BUF] == pl.WS]
  assert (relayed[:, pl.DST] != relayed[:, pl.FLOW_DST]).all()
  cross = ops[srv[ops[:, pl.SRC]] != srv[ops[:, pl.DST]]]
  assert (cross[:, pl.SRC] % m == cross[:, pl.DST] % m).all()
  assert (cross[:, pl.PHASE] >= 1).all()


def test_plan_rejects_a_schedule_that_moves_missing_rows():
  t = np.array([[0, 3], [0, 0]])
  sched = pl.ref.fast_schedule(t, 2, 1)
  sched.stages[2].transfers[0] = pl.ref.Transfer(0, 1, 4, (0, 1))
  with pytest.raises(ValueError, match="does not hold"):
    pl.execution_plan(t, 2, 1, schedule=sched)


def test_effective_traffic_clamps_in_order():
  counts = np.array([[2, 5, -1], [4, 4, 4], [0, 9, 1]])
  eff = pl.effective_traffic(counts, rows_in=6, rows_out=8)
  # Rows (x holds 6, destinations in order): [2, 4, 0], [4, 2, 0],
  # [0, 6, 0]; then columns (out holds 8, sources in order): column 1 gets
  # 4 + 2 + 2.
  np.testing.assert_array_equal(eff, [[2, 4, 0], [4, 2, 0], [0, 2, 0]])
  assert (eff.sum(1) <= 6).all() and (eff.sum(0) <= 8).all()
  t = np.array([[1, 2], [3, 0]])
  np.testing.assert_array_equal(pl.effective_traffic(t, 3, 4), t)


@given(buffer_cases())
def test_phase_arrays_pair_up(case):
  t, n, m, rows_in, rows_out = case
  g = n * m
  plan = pl.execution_plan(t, n, m)
  ws_rows = pl.workspace_rows(rows_in, rows_out, n, m)
  phases = pl.max_phases(n)
  arrs = [ph.phase_arrays(plan, r, rows_in, rows_out, ws_rows, phases,
                          rows_in + ws_rows, rows_out + ws_rows) for r in range(g)]
  sent = np.stack([a.send_sizes for a in arrs], axis=1)  # [PH, src, dst]
  recv = np.stack([a.recv_sizes for a in arrs], axis=2)  # [PH, src, dst]
  np.testing.assert_array_equal(sent, recv)
  for r, a in enumerate(arrs):
    assert int(a.num_phases) == plan.num_phases
    for q in range(g):  # my rows land where q expects rows from me
      np.testing.assert_array_equal(a.out_offsets[:, q], arrs[q].recv_offsets[:, r])
    assert (a.recv_rows[plan.num_phases:] == rows_out + ws_rows).all()


def test_phase_arrays_refuse_too_small_shapes():
  t = np.full((2, 2), 3)
  plan = pl.execution_plan(t, 2, 1)
  with pytest.raises(ValueError, match="room for"):
    ph.phase_arrays(plan, 0, 6, 6, 16, pl.max_phases(2), 2, 22)
  with pytest.raises(ValueError, match="phases"):
    ph.phase_arrays(plan, 0, 6, 6, 16, 1, 22, 22)


@needs_cpp
@given(traffic_cases())
def test_cpp_plan_matches_python(case):
  t, n, m = case
  a = pl.execution_plan(t, n, m)
  b = cpp.execution_plan(t, n, m)
  np.testing.assert_array_equal(a.ops, b.ops)
  assert a.num_phases == b.num_phases
  np.testing.assert_array_equal(a.workspace_used, b.workspace_used)


@needs_cpp
@given(buffer_cases(), st.sampled_from([1, 2, 6]))
def test_cpp_simulated_execution_is_exact(case, row_bytes):
  t, n, m, rows_in, rows_out = case
  rng = np.random.default_rng(int(t.sum()) + row_bytes)
  x = rng.integers(0, 256, (n * m, rows_in, row_bytes), dtype=np.uint8)
  ws_rows = pl.workspace_rows(rows_in, rows_out, n, m)
  out = cpp.simulate_execution(t, n, m, x, rows_out, ws_rows)
  np.testing.assert_array_equal(out, expected_out(t, x, rows_out))


@needs_cpp
def test_cpp_simulation_reports_bad_buffers():
  rng = np.random.default_rng(0)
  t = workloads.zipf_matrix(rng, 4, 0.9, mean=20)
  rows_in, rows_out = int(t.sum(1).max()), int(t.sum(0).max())
  x = np.zeros((4, rows_in, 2), np.uint8)
  with pytest.raises(ValueError, match="workspace rows"):
    cpp.simulate_execution(t, 2, 2, x, rows_out, 0)
  with pytest.raises(ValueError, match="receives"):
    cpp.simulate_execution(t, 2, 2, x, rows_out - 1, 100)
  with pytest.raises(ValueError, match="sends"):
    cpp.simulate_execution(t, 2, 2, x[:, :-1], rows_out, 100)
  with pytest.raises(ValueError, match="negative"):
    cpp.simulate_execution(-t, 2, 2, x, rows_out, 100)


@needs_cpp
def test_cpp_plan_at_scale():
  # 8 servers x 8 GPUs: the C++ plan checks out and stays inside the bound.
  rng = np.random.default_rng(3)
  t = workloads.zipf_matrix(rng, 64, 0.9, mean=50)
  plan = cpp.execution_plan(t, 8, 8)
  rows_in, rows_out = int(t.sum(1).max()), int(t.sum(0).max())
  ws_rows = pl.workspace_rows(rows_in, rows_out, 8, 8)
  assert (plan.workspace_used <= ws_rows).all()
  pl.check_plan(plan, t, rows_in, rows_out, ws_rows)


@given(traffic_cases())
def test_intra_server_part_spreads_over_the_stages(case):
  t, n, m = case
  s = ref.fast_schedule(t, n, m)
  plan = pl.execution_plan(t, n, m, s)
  ops = plan.ops
  cut = pl.intra_cuts(s.real, n)
  sb = s.num_bvn_stages
  for src in range(n * m):
    for dst in range(n * m):
      if src == dst or src // m != dst // m or t[src, dst] == 0:
        continue
      mine = ops[(ops[:, pl.SRC] == src) & (ops[:, pl.DST] == dst)
                 & (ops[:, pl.FLOW_SRC] == src) & (ops[:, pl.FLOW_DST] == dst)]
      # Stage k's share in phase k + 1, straight from x to out, rows in
      # order, covering the flow once; none past the first 2n stages.
      want = [(k + 1 if sb else 0, cut(t[src, dst], k),
               cut(t[src, dst], k + 1) - cut(t[src, dst], k))
              for k in range(max(sb, 1))]
      want = [w for w in want if w[2] > 0] if sb else [(0, 0, t[src, dst])]
      got = [(int(o[pl.PHASE]), int(o[pl.FLOW_ROW]), int(o[pl.ROWS]))
             for o in mine]
      assert got == want
      assert all(p <= 2 * n for p, _, _ in got)
      assert sum(r for _, _, r in got) == t[src, dst]


def _plan_of(case):
  """(schedule, the execution plan's ops, each GPU's server) of a case."""
  t, n, m = case
  s = ref.fast_schedule(t, n, m)
  return s, pl.execution_plan(t, n, m, s).ops, np.arange(n * m) // m


@given(traffic_cases())
def test_redistribution_runs_over_two_phases(case):
  s, ops, srv = _plan_of(case)
  sb = s.num_bvn_stages
  # Redistribution ops: within a server, from a GPU that is not the flow's
  # source, to the flow's destination.
  red = ops[(srv[ops[:, pl.SRC]] == srv[ops[:, pl.DST]])
            & (ops[:, pl.SRC] != ops[:, pl.FLOW_SRC])
            & (ops[:, pl.DST] == ops[:, pl.FLOW_DST])]
  want = np.zeros(sb + 2, np.int64)
  for k in range(sb):
    for tr in ref._stage_of_kind(s, "redistribute", k).transfers:
      late = pl.redistribution_split(tr.amount) if k < sb - 1 else 0
      want[k + 2] += tr.amount - late
      if late:
        want[k + 3] += late
  got = np.bincount(red[:, pl.PHASE], red[:, pl.ROWS], sb + 2) if sb else 0
  np.testing.assert_array_equal(got, want if sb else 0)
  # Each relayed piece leaves its GPU as at most two ops (head, tail), the
  # tail right after the head's rows, one phase later.
  for fs, fd, relay in {tuple(o) for o in red[:, [pl.FLOW_SRC, pl.FLOW_DST,
                                                  pl.SRC]]}:
    mine = red[(red[:, pl.FLOW_SRC] == fs) & (red[:, pl.FLOW_DST] == fd)
               & (red[:, pl.SRC] == relay)]
    rows = mine[np.argsort(mine[:, pl.FLOW_ROW], kind="stable")]
    assert (np.diff(rows[:, pl.PHASE]) >= 0).all()
    assert (rows[1:, pl.FLOW_ROW] == (rows[:, pl.FLOW_ROW]
                                      + rows[:, pl.ROWS])[:-1]).all()


@given(traffic_cases())
def test_balancing_runs_early_by_the_split(case):
  s, ops, srv = _plan_of(case)
  _, n, m = case
  sb = s.num_bvn_stages
  # Balancing ops: within a server, from the flow's source to a GPU that
  # is not its destination.
  bal = ops[(srv[ops[:, pl.SRC]] == srv[ops[:, pl.DST]])
            & (ops[:, pl.SRC] == ops[:, pl.FLOW_SRC])
            & (ops[:, pl.DST] != ops[:, pl.FLOW_DST])]
  early = pl.balancing_early(s.real, n, m)
  want = np.zeros(max(sb, 1), np.int64)
  for k in range(sb):
    for tr in ref._stage_of_kind(s, "scale_out", k).transfers:
      if tr.src_gpu != tr.flow[0]:
        first = early(tr.amount, k)
        assert first == 0 or k >= 2
        want[max(k - 1, 0)] += first
        want[k] += tr.amount - first
  got = np.bincount(bal[:, pl.PHASE], bal[:, pl.ROWS], max(sb, 1))
  np.testing.assert_array_equal(got, want)


def test_balancing_early_fills_the_previous_scale_out():
  # 8 GPUs a server: stage k's balancing needs 7 x its size (in rows / 9),
  # phase p hides 9 x the size of stage p - 1.  Sizes 1, 2, 10: stage 2
  # needs 70, its phase hides 18, phase 1 the next 9 (stage 1 gets none).
  early = pl.balancing_early(np.array([[1, 0], [2, 0], [10, 0]]), 2, 8)
  assert early(70, 2) == 9
  assert early(7, 2) == 0  # rounded down
  # Sizes 4, 2, 10: phase 1 hides 36 of stage 2's remaining 52.
  early = pl.balancing_early(np.array([[4, 0], [2, 0], [10, 0]]), 2, 8)
  assert early(70, 2) == 36
  assert early(70, 1) == 0 and early(70, 0) == 0

"""The staged (FAST) all-to-all from jit on 8 CPU devices: bitwise equal to
a direct ragged all-to-all, for EP 2/4/8 on 1/2/4 emulated servers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import PartitionSpec as P

from moe_jax import custom_calls
from moe_jax.fast import cpp, staged, workloads
from moe_jax.fast import plan as pl
from fast_testing import counts_matrix, expected_out, mesh_of, run_and_check

TOPOLOGIES = [(2, "1x2"), (2, "2x1"), (4, "1x4"), (4, "2x2"), (4, "4x1"),
              (8, "1x8"), (8, "2x4"), (8, "4x2")]
CPU_A2A = "moe_jax_all_to_all" in custom_calls.register().get("cpu", ())
ROWS, OUT_ROWS, HIDDEN = 24, 28, 4


def _run(ranks, topology, counts, *, rows=ROWS, out_rows=OUT_ROWS,
         tail=(HIDDEN,), dtype=jnp.float32, impl="callback",
         transport="custom_call" if CPU_A2A else "reference", planner="auto",
         seed=0):
  return run_and_check(ranks, topology, counts, rows=rows, out_rows=out_rows,
                       tail=tail, dtype=dtype, impl=impl, transport=transport,
                       planner=planner, backend="cpu", seed=seed)


def _counts(rng, kind, ranks, rows, out_rows):
  return counts_matrix(rng, kind, ranks, rows, out_rows)


@given(st.sampled_from(TOPOLOGIES), st.sampled_from(["zipf", "uniform", "one_hot",
                                                     "overflow"]),
       st.integers(0, 2**31 - 1))
def test_staged_equals_direct_all_to_all(topo, kind, seed):
  ranks, topology = topo
  rng = np.random.default_rng(seed)
  t = _run(ranks, topology, _counts(rng, kind, ranks, ROWS, OUT_ROWS), seed=seed)
  assert (t.sum(1) <= ROWS).all() and (t.sum(0) <= OUT_ROWS).all()


@pytest.mark.parametrize("ranks, topology", TOPOLOGIES)
def test_every_topology_on_zipf(ranks, topology):
  rng = np.random.default_rng(ranks)
  counts = workloads.zipf_matrix(rng, ranks, 0.9, mean=ROWS / ranks)
  t = _run(ranks, topology, counts)
  # The skew is real: some rank receives far more than another.
  assert t.sum(0).max() > 2 * max(1, t.sum(0).min())


@pytest.mark.parametrize("dtype, tail", [(jnp.bfloat16, (HIDDEN,)),
                                         (jnp.float32, (2, 3)),
                                         (jnp.int8, (5,))])
def test_dtypes_and_trailing_dims(dtype, tail):
  rng = np.random.default_rng(1)
  counts = _counts(rng, "zipf", 4, ROWS, OUT_ROWS)
  _run(4, "2x2", counts, tail=tail, dtype=dtype)


@pytest.mark.parametrize("transport, planner", [
    ("reference", "auto"), ("reference", "python"),
    pytest.param("custom_call", "cpp", marks=pytest.mark.skipif(
        not (CPU_A2A and cpp.available()), reason="C++ parts not built"))])
def test_transports_and_planners(transport, planner):
  rng = np.random.default_rng(2)
  for kind in ("zipf", "overflow"):
    _run(8, "4x2", _counts(rng, kind, 8, ROWS, OUT_ROWS), transport=transport,
         planner=planner)


def test_reference_impl_and_auto():
  rng = np.random.default_rng(3)
  counts = _counts(rng, "zipf", 4, ROWS, OUT_ROWS)
  _run(4, "2x2", counts, impl="reference")
  _run(4, "2x2", counts, impl="auto", transport="auto")


def test_round_trip_restores_the_rows():
  """Send, then send back with the received counts: every delivered row
  returns to where it was (one program, two staged calls)."""
  ranks, rows = 4, 16
  mesh = mesh_of(ranks, "cpu")

  def body(x, counts):
    out, got = staged.staged_all_to_all(x, counts[0], axis_name="ep",
                                        topology="2x2", out_rows=rows,
                                        impl="callback", platform="cpu")
    back, _ = staged.staged_all_to_all(out, got, axis_name="ep",
                                       topology="2x2", out_rows=rows,
                                       impl="callback", platform="cpu")
    return back

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")),
                             out_specs=P("ep")))
  rng = np.random.default_rng(4)
  counts = workloads.zipf_matrix(rng, ranks, 0.8, mean=3)
  counts = pl.effective_traffic(counts, rows, rows)
  x = rng.standard_normal((ranks * rows, 3)).astype(np.float32)
  back = np.asarray(fn(jnp.asarray(x), jnp.asarray(counts, jnp.int32)))
  for r in range(ranks):
    n = int(counts[r].sum())
    np.testing.assert_array_equal(back[r * rows:r * rows + n], x[r * rows:r * rows + n])
    assert not back[r * rows + n:(r + 1) * rows].any()


def _run_with_workspace(ranks, topology, counts, ws_rows, platform, rows=24):
  mesh = mesh_of(ranks, platform)

  def body(x, c):
    return staged.staged_all_to_all(x, c[0], axis_name="ep", topology=topology,
                                    out_rows=rows, workspace_rows=ws_rows,
                                    platform=platform)[0]

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")),
                             out_specs=P("ep")))
  x = np.arange(ranks * rows * 2, dtype=np.float32).reshape(ranks * rows, 2)
  return np.asarray(fn(jnp.asarray(x), jnp.asarray(counts, jnp.int32))), x


def test_workspace_rows_can_be_smaller_but_not_too_small():
  rng = np.random.default_rng(9)
  counts = pl.effective_traffic(workloads.zipf_matrix(rng, 4, 0.9, mean=5), 24, 24)
  need = int(pl.execution_plan(counts, 2, 2).workspace_used.max())
  assert 0 < need < pl.workspace_rows(24, 24, 2, 2)
  with pytest.raises(Exception, match="workspace rows"):
    _run_with_workspace(4, "2x2", counts, need - 1, "cpu")
  # Afterwards (the failed run's effect tokens are replaced) the exact size
  # works.
  out, x = _run_with_workspace(4, "2x2", counts, need, "cpu")
  want = expected_out(counts, x.reshape(4, 24, 2), 24)
  np.testing.assert_array_equal(out.reshape(want.shape), want)


def test_argument_errors():
  mesh = mesh_of(4, "cpu")

  def trace(x_shape=(8, 2), counts_shape=(4,), counts_dtype=jnp.int32, **kw):
    kw.setdefault("platform", "cpu")

    def body(x, c):
      return staged.staged_all_to_all(x, c, axis_name="ep", **kw)[0]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
    xs = jax.ShapeDtypeStruct((4 * x_shape[0],) + x_shape[1:], jnp.float32)
    cs = jax.ShapeDtypeStruct((4 * counts_shape[0],) + counts_shape[1:], counts_dtype)
    jax.jit(fn).trace(xs, cs)

  trace()
  with pytest.raises(ValueError, match="argument 'topology'.*3 GPUs"):
    trace(topology="3x1")
  with pytest.raises(ValueError, match="argument 'topology'"):
    trace(topology=(2, 2))
  with pytest.raises(ValueError, match="argument 'send_counts'"):
    trace(counts_shape=(3,))
  with pytest.raises(ValueError, match="argument 'send_counts'"):
    trace(counts_dtype=jnp.float32)
  with pytest.raises(ValueError, match="argument 'out_rows'"):
    trace(out_rows=0)
  with pytest.raises(ValueError, match="argument 'impl'"):
    trace(impl="nccl")
  with pytest.raises(ValueError, match="argument 'impl'.*GPUs only"):
    trace(impl="custom_call")
  with pytest.raises(ValueError, match="argument 'transport'.*XLA:CPU"):
    trace(transport="lax")
  with pytest.raises(ValueError, match="argument 'planner'"):
    trace(planner="java")
  with pytest.raises(ValueError, match="argument 'workspace_rows'"):
    trace(workspace_rows=-1)
  with pytest.raises(ValueError, match="argument 'x'"):
    trace(x_shape=(0, 2))
  with pytest.raises(ValueError, match="argument 'axis_name'"):
    jax.jit(jax.shard_map(
        lambda x, c: staged.staged_all_to_all(x, c, axis_name="tp", platform="cpu")[0],
        mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))).trace(
            jax.ShapeDtypeStruct((32, 2), jnp.float32),
            jax.ShapeDtypeStruct((16,), jnp.int32))

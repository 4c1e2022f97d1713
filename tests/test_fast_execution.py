"""The staged (FAST) all-to-all from jit on 8 CPU devices: bitwise equal to
a direct ragged all-to-all, for EP 2/4/8 on 1/2/4 emulated servers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_jax import custom_calls
from moe_jax.fast import cpp, staged, workloads
from moe_jax.fast import plan as pl
from fast_testing import expected_out

TOPOLOGIES = [(2, "1x2"), (2, "2x1"), (4, "1x4"), (4, "2x2"), (4, "4x1"),
              (8, "1x8"), (8, "2x4"), (8, "4x2")]
CPU_A2A = "moe_jax_all_to_all" in custom_calls.register().get("cpu", ())
ROWS, OUT_ROWS, HIDDEN = 24, 28, 4


def _mesh(ranks):
  return jax.make_mesh((ranks,), ("ep",), devices=jax.devices("cpu")[:ranks],
                       axis_types=(jax.sharding.AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def _runner(ranks, topology, out_rows, impl, transport, planner):
  """jit(shard_map): (x [P*R, ...], counts [P, P]) -> staged out/counts,
  reference out/counts, and moe_jax's CPU ragged all-to-all (direct)."""

  def body(x, counts):
    c = counts[0]
    out, got = staged.staged_all_to_all(
        x, c, axis_name="ep", topology=topology, out_rows=out_rows, impl=impl,
        transport=transport, planner=planner, platform="cpu")
    ref, ref_counts = staged.reference_all_to_all(x, c, axis_name="ep",
                                                  out_rows=out_rows)
    t = staged.effective_traffic(jax.lax.all_gather(c, "ep"), x.shape[0], out_rows)
    me = jax.lax.axis_index("ep")
    send_off = (jnp.cumsum(t[me]) - t[me]).astype(jnp.int32)
    recv_off = (jnp.cumsum(t[:, me]) - t[:, me]).astype(jnp.int32)
    direct, _ = custom_calls.ragged_all_to_all(
        x, send_off, t[me].astype(jnp.int32), recv_off, recv_rows=out_rows,
        axis_name="ep", impl="custom_call" if CPU_A2A else "reference")
    return out, got[None], ref, ref_counts[None], direct

  mesh = _mesh(ranks)
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")),
                             out_specs=(P("ep"),) * 5))
  return mesh, fn


def _poisoned_rows(rng, counts, rows, tail, dtype):
  """[P, rows, *tail]: distinct finite values in the rows a rank sends,
  0xFF bytes (NaN for floats) past them: the poison must never arrive."""
  ranks = counts.shape[0]
  ids = rng.permutation(ranks * rows * int(np.prod(tail))).reshape(
      (ranks, rows) + tail) + 1
  nbytes = np.dtype(dtype).itemsize
  if nbytes == 4:
    x = (ids + 0x3F000000).astype(np.uint32)
  elif nbytes == 2:
    x = (ids + 0x3C00).astype(np.uint16)
  else:
    x = (ids % 250 + 1).astype(np.uint8)
  x = x.view(dtype)
  sent = np.clip(counts, 0, None).sum(1)
  raw = x.view(np.uint8).reshape(ranks, rows, -1)
  for r in range(ranks):
    raw[r, min(sent[r], rows):] = 0xFF
  return x


def _bits(a):
  a = np.ascontiguousarray(np.asarray(a))
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _run(ranks, topology, counts, *, rows=ROWS, out_rows=OUT_ROWS,
         tail=(HIDDEN,), dtype=jnp.float32, impl="callback",
         transport="custom_call" if CPU_A2A else "reference", planner="auto",
         seed=0):
  rng = np.random.default_rng(seed)
  x = _poisoned_rows(rng, counts, rows, tail, np.dtype(dtype))
  mesh, fn = _runner(ranks, topology, out_rows, impl, transport, planner)
  shard = NamedSharding(mesh, P("ep"))
  res = fn(jax.device_put(jnp.asarray(x.reshape((ranks * rows,) + tail)), shard),
           jax.device_put(jnp.asarray(counts, jnp.int32), shard))
  out, got, ref, ref_counts, direct = (np.asarray(r) for r in res)
  out = out.reshape((ranks, out_rows) + tail)
  t = pl.effective_traffic(counts, rows, out_rows)
  want = expected_out(t, x, out_rows)
  np.testing.assert_array_equal(_bits(ref.reshape(want.shape)), _bits(want))
  np.testing.assert_array_equal(_bits(direct.reshape(want.shape)), _bits(want))
  np.testing.assert_array_equal(_bits(out), _bits(want),
                                err_msg=f"{topology} {impl}/{transport}")
  np.testing.assert_array_equal(got, t.T)
  np.testing.assert_array_equal(ref_counts, t.T)
  return t


def _counts(rng, kind, ranks, rows, out_rows):
  if kind == "zipf":
    t = workloads.zipf_matrix(rng, ranks, rng.uniform(0.4, 0.9),
                              mean=rng.uniform(0.5, 1.0) * min(rows, out_rows) / ranks)
  elif kind == "uniform":
    t = rng.integers(0, 2 * min(rows, out_rows) // ranks + 1, (ranks, ranks))
  elif kind == "one_hot":  # every rank sends everything to one rank
    t = np.zeros((ranks, ranks), np.int64)
    t[:, rng.integers(ranks)] = out_rows // ranks
  else:  # "overflow": more than the buffers hold, negatives too
    t = rng.integers(-3, rows, (ranks, ranks))
  return t.astype(np.int64)


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
  mesh = _mesh(ranks)

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


def test_argument_errors():
  mesh = _mesh(4)

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
  with pytest.raises(ValueError, match="argument 'x'"):
    trace(x_shape=(0, 2))
  with pytest.raises(ValueError, match="argument 'axis_name'"):
    jax.jit(jax.shard_map(
        lambda x, c: staged.staged_all_to_all(x, c, axis_name="tp", platform="cpu")[0],
        mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))).trace(
            jax.ShapeDtypeStruct((32, 2), jnp.float32),
            jax.ShapeDtypeStruct((16,), jnp.int32))

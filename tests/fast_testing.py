"""Shared helpers of the FAST tests: traffic strategies, the expected
result of a ragged all-to-all, and a runner of the staged all-to-all under
shard_map (CPU or GPU devices) that checks it bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_jax import custom_calls
from moe_jax.fast import plan as pl
from moe_jax.fast import staged, workloads


@st.composite
def traffic_cases(draw):
    """(traffic [G, G] int64, servers n, GPUs per server m): uniform, Zipf
    (0.4-0.9) or sparse random matrices on 1-8 servers x 1-8 GPUs."""
    n = draw(st.integers(1, 8))
    m = draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["uniform", "zipf", "sparse"]))
    g = n * m
    if kind == "uniform":
        t = workloads.uniform_matrix(rng, g, mean=draw(st.sampled_from([1, 5, 100, 500])))
    elif kind == "zipf":
        t = workloads.zipf_matrix(rng, g, draw(st.floats(0.4, 0.9)),
                                  mean=draw(st.sampled_from([3, 50, 1000])))
    else:
        t = rng.integers(0, 20, (g, g)) * (rng.random((g, g)) < 0.15)
    return t.astype(np.int64), n, m


@st.composite
def buffer_cases(draw, max_servers=4, max_gpus_per_server=4):
  """(traffic, n, m, rows_in, rows_out): a smaller traffic matrix (uniform,
  Zipf 0.4-0.9 or sparse; up to 4 x 4 GPUs) and buffer sizes that hold it,
  with 0-3 rows of slack each."""
  n = draw(st.integers(1, max_servers))
  m = draw(st.integers(1, max_gpus_per_server))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  kind = draw(st.sampled_from(["uniform", "zipf", "sparse"]))
  g = n * m
  if kind == "uniform":
    t = workloads.uniform_matrix(rng, g, mean=draw(st.sampled_from([1, 4, 20])))
  elif kind == "zipf":
    t = workloads.zipf_matrix(rng, g, draw(st.floats(0.4, 0.9)),
                              mean=draw(st.sampled_from([2, 10, 40])))
  else:
    t = rng.integers(0, 20, (g, g)) * (rng.random((g, g)) < 0.25)
  t = t.astype(np.int64)
  rows_in = max(1, int(t.sum(1).max()) + draw(st.integers(0, 3)))
  rows_out = max(1, int(t.sum(0).max()) + draw(st.integers(0, 3)))
  return t, n, m, rows_in, rows_out


@st.composite
def rank_program_cases(draw):
  """(traffic, n, m): 1-6 servers x 1-8 GPUs; uniform, Zipf (0.4-0.9, over
  all entries or within each row), sparse random, or one hot sender and one
  hot receiver (their flows split over many balancing lanes)."""
  n = draw(st.integers(1, 6))
  m = draw(st.integers(1, 8))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  kind = draw(st.sampled_from(["uniform", "zipf", "zipf_row", "sparse", "hot"]))
  g = n * m
  if kind == "uniform":
    t = workloads.uniform_matrix(rng, g, mean=draw(st.sampled_from([1, 5, 100])))
  elif kind in ("zipf", "zipf_row"):
    t = workloads.zipf_matrix(rng, g, draw(st.floats(0.4, 0.9)),
                              mean=draw(st.sampled_from([3, 50, 1000])),
                              scope="row" if kind == "zipf_row" else "global")
  elif kind == "sparse":
    t = rng.integers(0, 20, (g, g)) * (rng.random((g, g)) < 0.15)
  else:
    t = rng.integers(0, 5, (g, g))
    t[rng.integers(g), :] += 500
    t[:, rng.integers(g)] += 300
  return t.astype(np.int64), n, m


def expected_out(traffic, x, rows_out):
  """[G, rows_out, ...]: what a ragged all-to-all of x [G, R, ...] with this
  traffic delivers (grouped by source, zero past the received total)."""
  t = np.asarray(traffic, np.int64)
  g = t.shape[0]
  so = np.cumsum(t, axis=1) - t
  ro = np.cumsum(t, axis=0) - t
  out = np.zeros((g, rows_out) + x.shape[2:], x.dtype)
  for s in range(g):
    for d in range(g):
      out[d, ro[s, d]:ro[s, d] + t[s, d]] = x[s, so[s, d]:so[s, d] + t[s, d]]
  return out


def poisoned_rows(rng, counts, rows, tail, dtype):
  """[P, rows, *tail]: distinct finite values in the rows a rank sends,
  0xFF bytes (NaN for floats) past them: the poison must never arrive."""
  ranks = counts.shape[0]
  ids = rng.permutation(ranks * rows * int(np.prod(tail))).reshape(
      (ranks, rows) + tuple(tail)) + 1
  nbytes = np.dtype(dtype).itemsize
  if nbytes == 4:
    x = (ids + 0x3F000000).astype(np.uint32)
  elif nbytes == 2:
    x = (ids % 0x3000 + 0x3C00).astype(np.uint16)
  else:
    x = (ids % 250 + 1).astype(np.uint8)
  x = x.view(dtype)
  sent = np.clip(counts, 0, None).sum(1)
  raw = x.view(np.uint8).reshape(ranks, rows, -1)
  for r in range(ranks):
    raw[r, min(sent[r], rows):] = 0xFF
  return x


def bits(a):
  """The array's bytes as unsigned ints of its width (NaN-safe equality)."""
  a = np.ascontiguousarray(np.asarray(a))
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def counts_matrix(rng, kind, ranks, rows, out_rows):
  """int64[P, P] requested counts: zipf (0.4-0.9), uniform, one_hot (every
  rank sends to one rank) or overflow (more than fits, negatives too)."""
  if kind == "zipf":
    t = workloads.zipf_matrix(rng, ranks, rng.uniform(0.4, 0.9),
                              mean=rng.uniform(0.5, 1.0) * min(rows, out_rows) / ranks)
  elif kind == "uniform":
    t = rng.integers(0, 2 * min(rows, out_rows) // ranks + 1, (ranks, ranks))
  elif kind == "one_hot":
    t = np.zeros((ranks, ranks), np.int64)
    t[:, rng.integers(ranks)] = out_rows // ranks
  elif kind == "overflow":
    t = rng.integers(-3, rows, (ranks, ranks))
  else:
    raise ValueError(kind)
  return t.astype(np.int64)


def mesh_of(ranks, backend):
  return jax.make_mesh((ranks,), ("ep",), devices=jax.devices(backend)[:ranks],
                       axis_types=(jax.sharding.AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def staged_runner(ranks, backend, topology, out_rows, impl, transport, planner):
  """jit(shard_map): (x [P*R, ...], counts [P, P]) -> (staged out, staged
  recv counts, reference out, reference recv counts, direct out).

  "direct" is moe_jax's ragged all-to-all (CPU custom call, else its
  all-gather reference) fed with the effective traffic's offsets.
  """
  platform = "cpu" if backend == "cpu" else "gpu"
  cpu_a2a = "moe_jax_all_to_all" in custom_calls.register().get("cpu", ())

  def body(x, counts):
    c = counts[0]
    out, got = staged.staged_all_to_all(
        x, c, axis_name="ep", topology=topology, out_rows=out_rows, impl=impl,
        transport=transport, planner=planner, platform=platform)
    ref, ref_counts = staged.reference_all_to_all(x, c, axis_name="ep",
                                                  out_rows=out_rows)
    t = staged.effective_traffic(jax.lax.all_gather(c, "ep"), x.shape[0], out_rows)
    me = jax.lax.axis_index("ep")
    send_off = (jnp.cumsum(t[me]) - t[me]).astype(jnp.int32)
    recv_off = (jnp.cumsum(t[:, me]) - t[:, me]).astype(jnp.int32)
    direct, _ = custom_calls.ragged_all_to_all(
        x, send_off, t[me].astype(jnp.int32), recv_off, recv_rows=out_rows,
        axis_name="ep",
        impl="custom_call" if cpu_a2a and platform == "cpu" else "reference")
    return out, got[None], ref, ref_counts[None], direct

  mesh = mesh_of(ranks, backend)
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")),
                             out_specs=(P("ep"),) * 5))
  return mesh, fn


def run_and_check(ranks, topology, counts, *, rows, out_rows, tail, dtype,
                  impl, transport, planner="auto", backend="cpu", seed=0):
  """Runs staged_runner on poisoned rows; asserts staged, reference and
  direct results equal the NumPy expectation bit for bit.  Returns the
  effective traffic."""
  rng = np.random.default_rng(seed)
  x = poisoned_rows(rng, counts, rows, tuple(tail), np.dtype(dtype))
  mesh, fn = staged_runner(ranks, backend, topology, out_rows, impl, transport,
                           planner)
  shard = NamedSharding(mesh, P("ep"))
  res = fn(jax.device_put(jnp.asarray(x.reshape((ranks * rows,) + tuple(tail))), shard),
           jax.device_put(jnp.asarray(counts, jnp.int32), shard))
  out, got, ref, ref_counts, direct = (np.asarray(r) for r in res)
  t = pl.effective_traffic(counts, rows, out_rows)
  want = expected_out(t, x, out_rows)
  np.testing.assert_array_equal(bits(ref.reshape(want.shape)), bits(want))
  np.testing.assert_array_equal(bits(direct.reshape(want.shape)), bits(want))
  np.testing.assert_array_equal(bits(out.reshape(want.shape)), bits(want),
                                err_msg=f"{topology} {impl}/{transport}")
  np.testing.assert_array_equal(got, t.T)
  np.testing.assert_array_equal(ref_counts, t.T)
  return t

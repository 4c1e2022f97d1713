"""Shared hypothesis strategy for the FAST scheduler tests."""

import numpy as np
from hypothesis import strategies as st

from moe_jax.fast import workloads


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

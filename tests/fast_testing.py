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

"""CUDA pack / combine equal their pure-JAX references bit for bit (1 GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moe_jax import custom_calls
from moe_jax.plan import make_plan
from moe_testing import ROUTINGS, bits, make_routing

pytestmark = pytest.mark.gpu
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _on_gpu(*arrays):
    return jax.device_put(arrays, jax.devices("gpu")[0])


@settings(max_examples=15)
@given(st.integers(1, 300), st.sampled_from([1, 2, 4, 8]), st.integers(1, 4),
       st.sampled_from(ROUTINGS), st.integers(0, 40), st.integers(0, 9), st.integers(0, 5),
       st.sampled_from([8, 24, 4096, 7168 + 8]), st.sampled_from(DTYPES),
       st.sampled_from(DTYPES), st.integers(0, 2**31 - 1))
def test_cuda_pack_and_combine_equal_reference(tokens, ranks, top_k, kind, capacity, spill,
                                               start, hidden, dtype, out_dtype, seed):
    top_k = min(top_k, ranks)
    rng = np.random.default_rng(seed)
    ids = make_routing(rng, tokens, ranks, top_k, kind, 1)
    plan = make_plan(jnp.asarray(ids), ranks, 1)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    args = _on_gpu(x, plan.sorted_slots, plan.send_offsets, plan.send_counts)
    kw = dict(top_k=top_k, start=start, capacity=capacity, spill_capacity=spill)
    got = jax.jit(lambda *a: custom_calls.pack(*a, platform="gpu", **kw))(*args)
    want = jax.jit(lambda *a: custom_calls.pack(*a, impl="reference", **kw))(*args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(np.asarray(g)), bits(np.asarray(w)))
    weights = jnp.asarray(rng.standard_normal((tokens, top_k)), jnp.float32)
    cargs = _on_gpu(got[0], got[1], plan.dest, plan.pos, weights)
    ckw = dict(start=start, out_dtype=out_dtype)
    out = jax.jit(lambda *a: custom_calls.combine(*a, platform="gpu", **ckw))(*cargs)
    ref = jax.jit(lambda *a: custom_calls.combine(*a, impl="reference", **ckw))(*cargs)
    np.testing.assert_array_equal(bits(np.asarray(out)), bits(np.asarray(ref)))

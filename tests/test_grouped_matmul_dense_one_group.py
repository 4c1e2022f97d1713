"""The single-group dense path of grouped_matmul's impl="auto" (taken on
Hopper GPUs for one small group; its arithmetic is checked here on the CPU
against lax.ragged_dot, the GPU test checks that "auto" takes it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops import grouped_matmul as gmm


@pytest.mark.parametrize("rows, size", [(1, 1), (33, 20), (16, 16), (12, -2), (8, 50)])
def test_dense_one_group_is_ragged_dot_of_one_group(rows, size):
    rng = np.random.default_rng(rows + size)
    x = jnp.asarray(rng.standard_normal((rows, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((1, 24, 40)), jnp.float32)
    sizes = jnp.asarray([size], jnp.int32)
    got = np.asarray(jax.jit(gmm._dense_one_group)(x, w, sizes))
    want = np.asarray(jax.jit(gmm._ragged_dot)(x, w, sizes))
    covered = min(max(size, 0), rows)
    assert got.dtype == np.float32 and got.shape == (rows, 40)
    assert not got[covered:].any()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_auto_takes_it_only_for_one_small_group_on_the_cutlass_path():
    x = jnp.zeros((gmm.SINGLE_GROUP_DENSE_ROWS, 8), jnp.bfloat16)
    one, two = jnp.zeros((1, 8, 8), jnp.bfloat16), jnp.zeros((2, 8, 8), jnp.bfloat16)
    assert gmm._single_group_dense("auto", "cutlass", x, one)
    assert not gmm._single_group_dense("auto", "cutlass", x, two)
    assert not gmm._single_group_dense("auto", "cutlass", jnp.zeros((gmm.SINGLE_GROUP_DENSE_ROWS + 1, 8), jnp.bfloat16), one)
    assert not gmm._single_group_dense("cutlass", "cutlass", x, one)
    assert not gmm._single_group_dense("auto", "xla", x, one)

"""The dense path of grouped_matmul's impl="auto" (taken on Hopper GPUs
where the grouped kernel would have too few tiles; its arithmetic is checked
here on the CPU against lax.ragged_dot, the GPU test checks that "auto"
takes it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops import grouped_matmul as gmm


@pytest.mark.parametrize("rows, sizes", [
    (1, [1]), (33, [20]), (16, [16]), (12, [-2]), (8, [50]),
    (40, [7, 0, 20, 5]), (24, [0, 0, 30]), (17, [3, -4, 9]), (9, [0, 0]), (64, [64, 1])])
def test_dense_groups_is_ragged_dot(rows, sizes):
    rng = np.random.default_rng(rows + sum(sizes) + 7 * len(sizes))
    x = jnp.asarray(rng.standard_normal((rows, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((len(sizes), 24, 40)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(jax.jit(gmm._dense_groups)(x, w, gs))
    want = np.asarray(jax.jit(gmm._ragged_dot)(x, w, gs))
    covered = min(sum(max(s, 0) for s in sizes), rows)
    assert got.dtype == np.float32 and got.shape == (rows, 40)
    assert not got[covered:].any()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dense_groups_gradients_are_ragged_dots():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((30, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 16, 8)), jnp.float32)
    gs = jnp.asarray([9, 0, 17], jnp.int32)
    cot = jnp.asarray(rng.standard_normal((30, 8)), jnp.float32)

    def grads(fn):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w, gs) * cot), argnums=(0, 1)))(x, w)

    got, want = grads(gmm._dense_groups), grads(gmm._ragged_dot)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)
    assert not np.asarray(got[0])[26:].any(), "rows past the groups get no gradient"
    assert not np.asarray(got[1])[1].any(), "the empty group's weights get none"


@pytest.mark.parametrize("groups, rows, n, dense", [
    (1, 512, 4096, True), (1, 513, 4096, False), (1, 512, 28672, True),
    (2, 256, 4096, True), (2, 257, 4096, False), (2, 64, 28672, False),
    (4, 256, 4096, True), (4, 257, 4096, False), (8, 128, 4096, True),
    (8, 129, 4096, False), (16, 16, 4096, False), (0, 16, 4096, False)])
def test_dense_instead_where_the_kernel_has_too_few_tiles(groups, rows, n, dense):
    """132 SMs (H100 / H200): the Mixtral down projection (N = 4096, 16
    column tiles per group) runs dense up to 8 groups, its gate/up (2F =
    28672, 112 tiles) only as one group."""
    assert gmm.dense_instead(groups, rows, n, sm_count=132) == dense


def test_auto_takes_it_only_on_the_cutlass_path():
    x, w = jnp.zeros((64, 8), jnp.bfloat16), jnp.zeros((2, 8, 8), jnp.bfloat16)
    assert gmm._runs_dense("auto", "cutlass", x, w)
    assert not gmm._runs_dense("cutlass", "cutlass", x, w)
    assert not gmm._runs_dense("row_invariant", "cutlass", x, w)
    assert not gmm._runs_dense("auto", "xla", x, w)

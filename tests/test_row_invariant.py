"""moe_jax_row_matmul on the CPU: every output row is bitwise a function of
its input row and its group's weights; results agree with lax.ragged_dot.
Every call runs on CPU devices, also on hosts with a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import PartitionSpec as P

from moe_jax import row_invariant
from moe_testing import bits, mesh_of
from row_invariant_testing import (DTYPES, assert_close_to_reference, assert_rows_invariant,
                                   group_rows, random_case, run, sequential_float32_sum)


@given(st.lists(st.integers(-2, 12), min_size=1, max_size=5), st.integers(-3, 6),
       st.sampled_from([1, 5, 16, 33]), st.sampled_from([1, 7, 64, 70]),
       st.sampled_from(DTYPES), st.integers(0, 2**31 - 1))
def test_matches_reference_and_zeroes_the_tail(sizes, extra_rows, depth, cols, dtype, seed):
    rng = np.random.default_rng(seed)
    rows = max(sum(max(s, 0) for s in sizes) + extra_rows, 0)
    x, w, gs = random_case(rng, sizes, rows, depth, cols, dtype)
    got = run(x, w, gs)
    assert got.dtype == np.float32 and got.shape == (rows, cols)
    _, covered = group_rows(sizes, rows)
    assert not bits(got[covered:]).any(), "rows past sum(group_sizes) must be +0.0"
    assert_close_to_reference(got, x, w, gs)


@given(st.lists(st.integers(0, 9), min_size=1, max_size=4), st.integers(0, 3),
       st.sampled_from([1, 3, 40]), st.sampled_from([1, 9, 300]), st.sampled_from(DTYPES),
       st.integers(0, 2**31 - 1))
def test_cpu_arithmetic_is_the_sequential_float32_sum(sizes, extra_rows, depth, cols, dtype,
                                                      seed):
    rng = np.random.default_rng(seed)
    x, w, gs = random_case(rng, sizes, sum(sizes) + extra_rows, depth, cols, dtype)
    np.testing.assert_array_equal(bits(run(x, w, gs)), bits(sequential_float32_sum(x, w, sizes)))


SIZE_LISTS = st.one_of(
    st.lists(st.integers(0, 12), min_size=1, max_size=6),
    st.integers(1, 30).map(lambda n: [0, n, 0]),  # every row in one group
)


@given(SIZE_LISTS, st.integers(0, 5), st.sampled_from([1, 8, 33]), st.sampled_from([3, 64, 70]),
       st.sampled_from(DTYPES), st.integers(0, 2**31 - 1))
def test_rows_do_not_depend_on_the_other_rows(sizes, extra_rows, depth, cols, dtype, seed):
    rng = np.random.default_rng(seed)
    x, w, _ = random_case(rng, sizes, sum(sizes) + extra_rows, depth, cols, dtype)
    assert_rows_invariant(rng, x, w, sizes, run)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_alone_gives_the_same_bits(dtype):
    rng = np.random.default_rng(7)
    sizes = [3, 0, 5, 1]
    x, w, gs = random_case(rng, sizes, 11, 24, 40, dtype)
    full = run(x, w, gs)
    group_of = np.repeat(np.arange(len(sizes)), sizes)
    for i, g in enumerate(group_of):
        one_hot = jnp.asarray(np.eye(len(sizes), dtype=np.int32)[g])
        np.testing.assert_array_equal(bits(run(x[i:i + 1], w, one_hot))[0], bits(full[i]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_is_the_single_group_case(dtype):
    rng = np.random.default_rng(3)
    x, w, _ = random_case(rng, [1], 13, 20, 30, dtype)
    x, w = jax.device_put((x, w), jax.devices("cpu")[0])
    got = np.asarray(jax.jit(lambda x, w: row_invariant.matmul(x, w, platform="cpu"))(x, w[0]))
    np.testing.assert_array_equal(bits(got), bits(run(x, w, jnp.asarray([13], jnp.int32))))
    ref = np.asarray(row_invariant.matmul(x, w[0], impl="reference"))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


RANKS = 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w_spec", [P(), P("ep")])
def test_shard_map_gives_the_same_bits(dtype, w_spec):
    """Inside shard_map on 4 CPU devices, each device's rows equal the bits of
    a call outside shard_map on that device's rows (w replicated or split)."""
    rng = np.random.default_rng(11)
    groups, rows = 8, 20
    local_groups = groups // RANKS if w_spec == P("ep") else groups
    sizes = rng.integers(0, 5, size=(RANKS, local_groups)).astype(np.int32)
    x, w, _ = random_case(rng, [0] * groups, RANKS * rows, 12, 24, dtype)
    mesh = mesh_of(RANKS)
    fn = jax.jit(jax.shard_map(
        lambda x, w, s: row_invariant.grouped_matmul(x, w, s, platform="cpu"), mesh=mesh,
        in_specs=(P("ep"), w_spec, P("ep")), out_specs=P("ep")))
    got = np.asarray(fn(x, w, jnp.asarray(sizes.reshape(-1))))
    for r in range(RANKS):
        w_r = w[r * local_groups:(r + 1) * local_groups] if w_spec == P("ep") else w
        want = run(x[r * rows:(r + 1) * rows], w_r, jnp.asarray(sizes[r]))
        np.testing.assert_array_equal(bits(got[r * rows:(r + 1) * rows]), bits(want))


def test_shard_map_with_replicated_group_sizes_and_matmul():
    rng = np.random.default_rng(5)
    x, w, _ = random_case(rng, [0, 0], RANKS * 6, 10, 16, jnp.bfloat16)
    sizes = jnp.asarray([2, 3], jnp.int32)
    mesh = mesh_of(RANKS)

    def body(x, w, s):
        return (row_invariant.grouped_matmul(x, w, s, platform="cpu"),
                row_invariant.matmul(x, w[1], platform="cpu"))

    grouped, single = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P(), P()),
                                            out_specs=(P("ep"), P("ep"))))(x, w, sizes)
    for r in range(RANKS):
        rows = slice(6 * r, 6 * r + 6)
        np.testing.assert_array_equal(bits(np.asarray(grouped)[rows]),
                                      bits(run(x[rows], w, sizes)))
        np.testing.assert_array_equal(bits(np.asarray(single)[rows]),
                                      bits(run(x[rows], w[1:], jnp.asarray([6], jnp.int32))))


def test_rejects_bad_arguments():
    x = jnp.ones((4, 8), jnp.float32)
    w = jnp.ones((2, 8, 3), jnp.float32)
    sizes = jnp.asarray([1, 2], jnp.int32)
    gm = row_invariant.grouped_matmul
    with pytest.raises(ValueError, match="'x'"):
        gm(x[None], w, sizes)
    with pytest.raises(ValueError, match="'x'"):
        gm(x.astype(jnp.int32), w, sizes)
    with pytest.raises(ValueError, match="'x'"):
        gm(x.astype(jnp.float16), w.astype(jnp.float16), sizes)
    with pytest.raises(ValueError, match="'w'"):
        gm(x, w.astype(jnp.bfloat16), sizes)
    with pytest.raises(ValueError, match="'w'"):
        gm(x, w[:, :7], sizes)
    with pytest.raises(ValueError, match="'w'"):
        gm(x, w[0], sizes)
    with pytest.raises(ValueError, match="'group_sizes'"):
        gm(x, w, sizes[:1])
    with pytest.raises(ValueError, match="'group_sizes'"):
        gm(x, w, sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match="'group_sizes'"):
        gm(x, w, sizes.reshape(2, 1))
    with pytest.raises(ValueError, match="'group_sizes'"):
        gm(x, w, None)
    with pytest.raises(ValueError, match="'impl'"):
        gm(x, w, sizes, impl="xla")
    with pytest.raises(ValueError, match="'w'"):
        row_invariant.matmul(x, w)

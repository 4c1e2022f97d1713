"""moe_jax_row_matmul on CUDA (1 GPU): rows are bitwise functions of their
input row and group weights, for any row count, inside CUDA graphs too;
results agree with lax.ragged_dot; float32 equals the CPU handler bitwise.

Run as a script (python tests/test_gpu_row_invariant.py OUT.npz), it saves
the results of replays of one compiled call; the graph test runs it with and
without command buffers and compares the bits.
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moe_jax import row_invariant
from graph_testing import assert_replays_match_without_graphs
from moe_testing import bits
from row_invariant_testing import (DTYPES, assert_close_to_reference, assert_rows_invariant,
                                    group_rows, random_case, run)

pytestmark = pytest.mark.gpu
run_gpu = functools.partial(run, backend="gpu")

# (sizes, extra rows, K, N): empty groups, partial 16- and 64-row tiles, K and
# N that are not multiples of 8 or 16 (the kernels' scalar loads), and the
# model's sizes.
SHAPES = [
    ([1], 0, 64, 64),
    ([5, 0, 32], 4, 72, 40),
    ([0, 77, 0, 150], 13, 256, 512),
    ([200, 313, 1, 0, 250, 64, 90, 82], 24, 1024, 1024),
    ([20, 43], 1, 100, 200),
    ([600, 0, 700, 748], 0, 4096, 256),
    ([3, 9], 5, 7, 5),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes, extra_rows, depth, cols", SHAPES)
def test_cuda_matches_reference_and_zeroes_the_tail(sizes, extra_rows, depth, cols, dtype):
    rng = np.random.default_rng(depth * cols + len(sizes))
    rows = sum(sizes) + extra_rows
    x, w, gs = random_case(rng, sizes, rows, depth, cols, dtype)
    got = run_gpu(x, w, gs)
    assert got.dtype == np.float32 and got.shape == (rows, cols)
    _, covered = group_rows(sizes, rows)
    assert not bits(got[covered:]).any(), "rows past sum(group_sizes) must be +0.0"
    assert_close_to_reference(got, x, w, gs, backend="gpu")


@pytest.mark.parametrize("sizes, extra_rows, depth, cols", SHAPES[:5])
def test_cuda_float32_equals_the_cpu_handler(sizes, extra_rows, depth, cols):
    """Both run +0.0f then acc + x * w over k in order, each op rounded."""
    rng = np.random.default_rng(5 + depth)
    x, w, gs = random_case(rng, sizes, sum(sizes) + extra_rows, depth, cols, jnp.float32)
    np.testing.assert_array_equal(bits(run_gpu(x, w, gs)), bits(run(x, w, gs)))


@settings(max_examples=25)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=6), st.integers(0, 70),
       st.sampled_from([16, 72, 256, 1024]), st.sampled_from([40, 64, 384]),
       st.sampled_from(DTYPES), st.integers(0, 2**31 - 1))
def test_cuda_rows_do_not_depend_on_the_other_rows(sizes, extra_rows, depth, cols, dtype, seed):
    rng = np.random.default_rng(seed)
    x, w, _ = random_case(rng, sizes, sum(sizes) + extra_rows, depth, cols, dtype)
    assert_rows_invariant(rng, x, w, sizes, run_gpu)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 16, 65, 500])
def test_cuda_rows_match_calls_on_fewer_rows(dtype, batch):
    """A full call on 1824 rows vs calls on consecutive batches of its rows
    (each batch one group, like a decode step's tokens)."""
    rng = np.random.default_rng(batch)
    sizes = [400, 0, 624, 800]
    x, w, gs = random_case(rng, sizes, sum(sizes), 512, 768, dtype)
    full = run_gpu(x, w, gs)
    group_begin, group_end = 400, 1024  # group 2's rows
    for start in list(range(group_begin, group_end - batch + 1, batch))[:4]:
        one_group = jnp.asarray([0, 0, batch, 0], jnp.int32)
        part = run_gpu(x[start:start + batch], w, one_group)
        np.testing.assert_array_equal(bits(part), bits(full[start:start + batch]))


def test_cuda_matmul_is_row_invariant():
    rng = np.random.default_rng(2)
    x, w, _ = random_case(rng, [1], 333, 640, 320, jnp.bfloat16)
    x, w = jax.device_put((x, w[0]), jax.devices("gpu")[0])
    fn = jax.jit(lambda x, w: row_invariant.matmul(x, w, platform="gpu"))
    full = np.asarray(fn(x, w))
    for rows in (slice(0, 1), slice(17, 18), slice(100, 333), slice(5, 70)):
        np.testing.assert_array_equal(bits(np.asarray(fn(x[rows], w))), bits(full[rows]))


def test_cuda_graph_replays_give_the_same_bits(tmp_path):
    """One compiled call replayed with other inputs and group sizes: the same
    bits with command buffers on (custom calls and fusions allowed in CUDA
    graphs) as with them off."""
    assert_replays_match_without_graphs(__file__, tmp_path)


def _replay_and_save(out_path: str) -> None:
    rng = np.random.default_rng(21)
    device = jax.devices("gpu")[0]
    results = {}
    for dtype in DTYPES:
        # The multiply by 2 (exact) adds a fusion to the captured sequence.
        fn = jax.jit(lambda x, w, s: 2.0 * row_invariant.grouped_matmul(x, w, s, platform="gpu"))
        for replay in range(4):
            sizes = [0, 316, 0, 0] if replay == 2 else list(rng.integers(0, 80, size=4))
            x, w, gs = jax.device_put(random_case(rng, sizes, 320, 96, 136, dtype), device)
            results[f"{jnp.dtype(dtype).name}_{replay}"] = np.asarray(fn(x, w, gs))
    np.savez(out_path, **results)
    print("PASS")


if __name__ == "__main__":
    _replay_and_save(sys.argv[1])

"""Async EP on GPUs (1 or more): with the row-invariant arithmetic every
kernel row is a function of its own inputs at every bucket, so the
asynchronous engines generate the synchronous baseline's tokens."""

import jax
import pytest

from moe_jax.async_ep.model import LayerKernels, TinyMoEConfig, init_params

from async_ep_testing import (assert_rows_independent_of_count, async_and_sync_outputs,
                              kernel_rows_by_count, random_requests)

pytestmark = pytest.mark.gpu

# The benchmark's model scaled down (hidden 512, not 2048), buckets up to 32.
CONFIG = TinyMoEConfig(vocab=256, hidden=512, ffn=1024, heads=4, num_blocks=2, num_experts=8,
                       top_k=2, max_len=40, expert_skew=3.0, matmul="row_invariant")
MAX_BATCH = 32


@pytest.fixture(scope="module")
def kernels():
    return LayerKernels(CONFIG, init_params(jax.random.PRNGKey(0), CONFIG), MAX_BATCH)


def test_kernel_rows_do_not_depend_on_the_batch(kernels):
    by_count = kernel_rows_by_count(kernels, jax.devices("gpu")[0], [1, 2, 3, 7, 8, 16, 17, 32])
    assert_rows_independent_of_count(by_count)


def test_async_engines_generate_the_sync_tokens(kernels):
    gpus = len(jax.devices("gpu"))
    num_devices, num_ranks = (1, 1) if gpus == 1 else (2, 2)
    requests = random_requests(24, CONFIG.vocab, seed=1, max_prompt=6, max_new=10)
    outputs = async_and_sync_outputs(kernels, requests, num_devices, num_ranks, 8, "gpu")
    for name, got in outputs.items():
        assert got == outputs["sync"], name

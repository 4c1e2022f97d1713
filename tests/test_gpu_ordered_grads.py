"""Weight gradients summed in one order, on GPUs: with the row-invariant
matmul every strategy's gradients are dense's bits (tests/test_ordered_grads.py
holds the CPU cases)."""

import jax.numpy as jnp
import pytest

from moe_testing import needs_gpus
from test_ordered_grads import check_every_strategy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("top_k, dtype", [(2, jnp.bfloat16), (3, jnp.float32),
                                          (8, jnp.bfloat16)])
def test_every_strategy_has_denses_gradient_bits_on_one_gpu(top_k, dtype):
    needs_gpus(1)
    check_every_strategy(1, top_k, dtype, backend="gpu")


@pytest.mark.multi_gpu
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("transport", ["lax", "nvlink"])
def test_every_strategy_has_denses_gradient_bits_on_gpus(ranks, transport):
    needs_gpus(ranks)
    strategies = ("ragged", "cap_and_spill") if transport == "nvlink" else (
        "max_counts", "ragged", "cap_and_spill")
    check_every_strategy(ranks, 3, jnp.bfloat16, backend="gpu", transport=transport,
                         strategies=strategies)

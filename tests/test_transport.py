"""transport="auto" and the transports a strategy cannot use."""

import logging
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax as mj
from moe_jax import topology
from moe_jax.dispatch import DispatchContext, dispatch_combine
from moe_testing import bits, mesh_of


def _gpus(n, process=0):
    return tuple(SimpleNamespace(platform="gpu", id=i, process_index=process)
                 for i in range(n))


@pytest.mark.parametrize("strategy, link, want", [
    ("ragged", "nvlink", "nvlink"), ("cap_and_spill", "nvlink", "nvlink"),
    ("max_counts", "nvlink", "custom_call"), ("ragged", "pcie", "lax"),
    ("cap_and_spill", "pcie", "custom_call"), ("cap_and_spill", "unknown", "custom_call"),
    ("ragged", "none", "lax"), ("dense", "nvlink", "lax")])
def test_auto_picks_from_the_gpu_topology(strategy, link, want):
    choice = topology.choose_transport(strategy, "gpu", _gpus(4), link=link)
    assert choice.transport == want
    assert choice.reason


def test_auto_on_cpu_is_the_in_process_call_within_one_process():
    cpus = jax.devices("cpu")[:4]
    assert topology.choose_transport("ragged", "cpu", cpus).transport == "custom_call"
    several = tuple(SimpleNamespace(platform="cpu", id=i, process_index=i % 2)
                    for i in range(4))
    assert topology.choose_transport("ragged", "cpu", several).transport == "lax"


def test_peer_link_without_local_gpus_is_unknown_or_trivial():
    assert topology.peer_link(_gpus(1)) == "nvlink"
    assert topology.peer_link(jax.devices("cpu")[:2]) == "unknown"


def test_auto_layer_runs_what_resolve_transport_names_and_logs_it(caplog):
    config = mj.MoEConfig(hidden_size=32, ffn_size=16, num_experts=8, top_k=2,
                          strategy="ragged", transport="auto", matmul="row_invariant",
                          dtype=jnp.float32)
    mesh = mesh_of(4)
    choice = mj.resolve_transport(config, mesh)
    assert choice.transport == "custom_call"
    params = mj.init_moe_params(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    with caplog.at_level(logging.INFO, logger="moe_jax"):
        got = jax.jit(lambda p, x: mj.moe_layer(p, x, config, mesh)[0])(params, x)
    assert any("transport='auto' runs 'custom_call'" in r.getMessage() for r in caplog.records)
    want = jax.jit(lambda p, x: mj.moe_layer(p, x, config.replace(transport="custom_call"),
                                             mesh)[0])(params, x)
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)))
    assert mj.resolve_transport(config.replace(transport="lax"), mesh) == ("lax", "configured")


def test_ragged_over_nccl_is_an_error_not_a_substitute():
    ctx = DispatchContext("ep", 2, "custom_call", "custom_call", "gpu")
    x = jnp.ones((4, 8), jnp.float32)
    ids = jnp.zeros((4, 2), jnp.int32).at[:, 1].set(1)
    w = jnp.ones((4, 2), jnp.float32)
    with pytest.raises(ValueError, match="no ragged exchange on GPUs"):
        dispatch_combine(x, ids, w, lambda rows, sizes: rows, strategy="ragged", ctx=ctx,
                         experts_per_rank=1)


def test_unresolved_auto_is_refused_by_dispatch_combine():
    ctx = DispatchContext(None, 1, "auto", "custom_call", "cpu")
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(ValueError, match="resolve 'auto'"):
        dispatch_combine(x, jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1), jnp.float32),
                         lambda rows, sizes: rows, strategy="dense", ctx=ctx,
                         experts_per_rank=1)

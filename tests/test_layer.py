"""The MoE layer and its Flax modules: outputs, compiled program, errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_jax as mj
from moe_jax.layer import init_moe_params, moe_layer
from moe_jax.nn import linen as moe_linen, nnx as moe_nnx
from moe_testing import bits, mesh_of, rel_error

CONFIG = mj.MoEConfig(hidden_size=32, ffn_size=48, num_experts=8, top_k=2,
                      strategy="cap_and_spill", capacity=2, spill_capacity=1)


def _mesh(ranks):
    return mesh_of(ranks, "cpu")


def _reference(params, x):
    config = CONFIG.replace(strategy="dense", dtype=jnp.float32, kernel_impl="reference")
    return jax.jit(lambda p, x: moe_layer(p, x, config)[0])(params, x)


@pytest.mark.parametrize("ranks", [4, 8])
@pytest.mark.parametrize("strategy", ["max_counts", "cap_and_spill", "ragged"])
def test_layer_output_matches_float32_reference(ranks, strategy):
    params = init_moe_params(jax.random.key(0), CONFIG)
    x = jax.random.normal(jax.random.key(ranks), (2, 8 * ranks, CONFIG.hidden_size))
    config = CONFIG.replace(strategy=strategy)
    y, aux = jax.jit(lambda p, x: moe_layer(p, x, config, _mesh(ranks)))(params, x)
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
    assert rel_error(y.astype(jnp.float32), _reference(params, x)) < 2e-2
    assert int(aux.stats.rows) == x.shape[0] * x.shape[1] * CONFIG.top_k
    assert np.isfinite(float(aux.load_balance_loss)) and float(aux.load_balance_loss) >= 1.0 - 1e-5


@pytest.mark.parametrize("ranks, top_k", [(2, 2), (4, 2), (4, 1), (4, 3), (2, 4), (4, 8)])
@pytest.mark.parametrize("strategy", ["max_counts", "cap_and_spill", "ragged"])
def test_row_invariant_matmul_gives_every_strategy_the_dense_bits(ranks, top_k, strategy):
    """C + S is half the mean stream: at top-k >= 2 cap-and-spill spills and
    falls back, and many tokens' picks travel in different passes."""
    tokens_per_rank = 32
    capacity = max(1, tokens_per_rank * top_k // (3 * ranks))
    config = CONFIG.replace(strategy=strategy, matmul="row_invariant", top_k=top_k,
                            capacity=capacity, spill_capacity=capacity // 2,
                            dtype=jnp.float32)   # bfloat16 outputs would hide last bits
    params = init_moe_params(jax.random.key(5), config)
    x = jax.random.normal(jax.random.key(6 + ranks + 10 * top_k),
                          (4, tokens_per_rank * ranks // 4, CONFIG.hidden_size))
    dense = config.replace(strategy="dense")
    want = jax.jit(lambda p, x: moe_layer(p, x, dense)[0])(params, x)
    got, aux = jax.jit(lambda p, x: moe_layer(p, x, config, _mesh(ranks)))(params, x)
    np.testing.assert_array_equal(bits(got), bits(want))
    if strategy == "cap_and_spill" and top_k >= 2:
        assert int(aux.stats.fallback_steps) == 1


def test_sigmoid_grouped_router_layer():
    config = CONFIG.replace(num_experts=16, router="sigmoid_grouped", num_groups=4,
                            topk_groups=2, top_k=4, strategy="max_counts")
    params = init_moe_params(jax.random.key(1), config)
    x = jax.random.normal(jax.random.key(2), (32, config.hidden_size))
    y, _ = jax.jit(lambda p, x: moe_layer(p, x, config, _mesh(8)))(params, x)
    ref, _ = jax.jit(lambda p, x: moe_layer(p, x, config.replace(strategy="dense",
                                                                 dtype=jnp.float32)))(params, x)
    assert rel_error(y.astype(jnp.float32), ref) < 2e-2


def test_cap_and_spill_hlo_has_no_host_transfer_or_callback():
    params = init_moe_params(jax.random.key(0), CONFIG)
    x = jnp.ones((64, CONFIG.hidden_size), jnp.float32)
    text = jax.jit(lambda p, x: moe_layer(p, x, CONFIG, _mesh(8))[0]).lower(
        params, x).compile().as_text()
    instructions = [line for line in text.splitlines() if re.match(r"\s*(ROOT )?%\S+ = ", line)]
    assert instructions
    opcodes = {re.search(r"= \S+ (\S+?)\(", line).group(1) for line in instructions
               if re.search(r"= \S+ (\S+?)\(", line)}
    targets = {m.group(1) for line in instructions
               for m in [re.search(r'custom_call_target="([^"]+)"', line)] if m}
    assert {"moe_jax_pack", "moe_jax_combine"} <= targets
    assert not [t for t in targets if "callback" in t.lower()], targets
    for op in ("send", "recv", "send-done", "recv-done", "infeed", "outfeed"):
        assert op not in opcodes, f"compiled cap_and_spill has a {op} instruction"
    assert not any("is_host_transfer=true" in line for line in instructions)


@pytest.mark.parametrize("data", [1, 2])   # 2: a ("data", "ep") mesh, data_axes=("data",)
def test_linen_module_matches_function(data):
    mesh = mesh_of(4, "cpu", data)
    config = CONFIG.replace(data_axes=("data",) if data > 1 else ())
    module = moe_linen.MoE(config, mesh)
    x = jax.random.normal(jax.random.key(3), (4, 8, CONFIG.hidden_size))
    variables = jax.jit(module.init)(jax.random.key(0), x)
    y, state = jax.jit(lambda v, x: module.apply(v, x, mutable=["moe_stats", "losses"]))(
        variables, x)
    p = variables["params"]
    params = mj.layer.MoEParams(p["router"], None, mj.ExpertWeights(
        p["w_gate_up"].unbox(), p["w_down"].unbox()))
    expected, _ = jax.jit(lambda p, x: moe_layer(p, x, config, mesh))(params, x)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(expected, np.float32))
    assert int(state["moe_stats"]["calls"]) == 1
    assert int(state["moe_stats"]["dispatch"].rows) == 4 * 8 * CONFIG.top_k
    assert state["losses"]["moe_aux_loss"][0].shape == ()


def test_nnx_module_counts_calls_and_stats():
    model = moe_nnx.MoE(CONFIG, mesh=_mesh(4), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(4), (32, CONFIG.hidden_size))
    step = nnx.jit(lambda m, x: m(x))
    y1 = step(model, x)
    y2 = step(model, x)
    np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y2, np.float32))
    assert int(model.calls[...]) == 2
    assert int(model.stats.get_value().rows) == 2 * 32 * CONFIG.top_k
    assert rel_error(y1.astype(jnp.float32), _reference(model.params(), x)) < 2e-2


@pytest.mark.parametrize("changes, argument", [
    (dict(top_k=9), "top_k"),
    (dict(capacity=0), "capacity"),
    (dict(capacity=None), "capacity"),
    (dict(spill_capacity=-1), "spill_capacity"),
    (dict(strategy="einsum"), "strategy"),
    (dict(transport="mpi"), "transport"),
    (dict(kernel_impl="triton"), "kernel_impl"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(router="sigmoid_grouped", num_groups=3), "num_groups"),
    (dict(router="sigmoid_grouped", num_groups=4, topk_groups=5), "topk_groups"),
    (dict(dtype=jnp.int32), "dtype"),
    (dict(matmul="cublas"), "matmul"),
    (dict(matmul="row_invariant", dtype=jnp.float16), "matmul"),
])
def test_bad_config_names_argument(changes, argument):
    with pytest.raises(ValueError, match=rf"MoEConfig\.{argument}\b"):
        CONFIG.replace(**changes)


def test_bad_layer_arguments_name_argument():
    params = init_moe_params(jax.random.key(0), CONFIG)
    with pytest.raises(ValueError, match="mesh"):
        moe_layer(params, jnp.ones((8, 32)), CONFIG, None)
    with pytest.raises(ValueError, match="expert axis 'ep'"):
        moe_layer(params, jnp.ones((8, 32)), CONFIG, jax.make_mesh((8,), ("data",)))
    with pytest.raises(ValueError, match="'x'"):
        moe_layer(params, jnp.ones((8, 31)), CONFIG, _mesh(8))
    with pytest.raises(ValueError, match="'x' has 12 tokens"):
        moe_layer(params, jnp.ones((12, 32)), CONFIG, _mesh(8))
    with pytest.raises(ValueError, match="num_experts"):
        moe_layer(init_moe_params(jax.random.key(0), CONFIG.replace(num_experts=6, top_k=2)),
                  jnp.ones((16, 32)), CONFIG.replace(num_experts=6), _mesh(4))

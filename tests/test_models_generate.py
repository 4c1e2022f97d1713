"""The example decoder: every strategy and EP size generates the same tokens;
linen, nnx and the pure reference agree; recorded traces calibrate C and S."""

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
import pytest
from flax import nnx

import moe_jax as mj
from moe_jax.models import (DecoderConfig, MixtralLinen, MixtralNnx, forward, init_cache,
                            init_params, nnx_load_params, nnx_params)
from moe_jax.models.generate import generate, pad_prompts
from moe_jax.traces import load_jsonl, per_peer_counts, save_jsonl
from moe_testing import mesh_of

NEW_TOKENS = 8
BASE = DecoderConfig.create(vocab_size=64, d_model=32, num_heads=4, num_layers=2,
                            num_experts=8, top_k=2, ffn_size=64, max_len=16)
# Small enough that the spill pass and the fallback both run.
TINY_CS = dict(capacity=1, spill_capacity=1)


@pytest.fixture(scope="module")
def params():
    return init_params(jax.random.key(0), BASE)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return pad_prompts([rng.integers(1, BASE.vocab_size, size=n).tolist()
                        for n in (3, 6, 2, 5, 6, 4, 1, 6)])


@pytest.fixture(scope="module")
def reference(params, prompts):
    """Greedy tokens of the dense model without a mesh."""
    return generate(MixtralLinen(BASE), params, *prompts, max_new_tokens=NEW_TOKENS).tokens


def _naive_greedy(params, tokens, mask, steps):
    """Greedy decoding by recomputing every sequence from scratch each step (a
    fresh cache every time; one compilation: the sequence buffer has a fixed
    length and causality keeps the not yet generated slots out)."""
    batch, length = tokens.shape
    total = length + steps
    buf = np.zeros((batch, total), np.int32)
    buf[:, :length] = tokens
    mask = np.concatenate([mask, np.ones((batch, steps), bool)], axis=1)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    valid = np.concatenate([mask, np.ones((batch, BASE.max_len - total), bool)], axis=1)
    logits_of = jax.jit(lambda p, t: forward(p, t, positions, init_cache(BASE, batch), 0,
                                             valid, BASE).logits)
    for s in range(steps):
        logits = logits_of(params, buf)
        buf[:, length + s] = np.asarray(jnp.argmax(logits[:, length + s - 1], axis=-1))
    return buf[:, length:]


@pytest.mark.parametrize("changes, argument", [
    (dict(d_model=30), "num_heads"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(top_k=9), "top_k"),
    (dict(max_len=-1), "max_len"),
    (dict(strategy="cap_and_spill"), "capacity"),
    (dict(strategy="bogus"), "strategy"),
    (dict(bogus=1), "bogus"),
    (dict(moe={"hidden_size": 32}), "moe"),
])
def test_config_rejects_bad_arguments(changes, argument):
    with pytest.raises(ValueError, match=argument):
        BASE.replace(**changes)


def test_config_nests_the_moe_config():
    cfg = BASE.replace(strategy="cap_and_spill", capacity=3, spill_capacity=1, num_layers=3)
    assert cfg.moe == BASE.moe.replace(strategy="cap_and_spill", capacity=3, spill_capacity=1)
    assert cfg.num_layers == 3 and BASE.num_layers == 2
    assert cfg.d_model == cfg.moe.hidden_size == 32 and cfg.head_dim == 8
    assert cfg.dtype == cfg.moe.dtype == jnp.float32
    assert DecoderConfig(vocab_size=64, num_heads=4, num_layers=3, max_len=16,
                         moe=cfg.moe) == cfg
    wide = cfg.replace(d_model=64)
    assert wide.moe.hidden_size == 64 and wide.moe.capacity == 3
    assert hash(cfg) == hash(BASE.replace(num_layers=3, strategy="cap_and_spill", capacity=3,
                                          spill_capacity=1))


def test_generate_rejects_bad_arguments(params, prompts):
    model = MixtralLinen(BASE.replace(strategy="ragged"), mesh_of(4))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, params, *prompts, max_new_tokens=BASE.max_len)
    with pytest.raises(ValueError, match="prompt_tokens"):
        generate(model, params, prompts[0][:6], prompts[1][:6], max_new_tokens=2)
    six = BASE.replace(num_experts=6, strategy="ragged")
    with pytest.raises(ValueError, match="num_experts"):
        generate(MixtralLinen(six, mesh_of(4)), init_params(jax.random.key(0), six), *prompts,
                 max_new_tokens=2)


def test_kv_cache_generation_matches_recomputation(params, prompts, reference):
    np.testing.assert_array_equal(reference, _naive_greedy(params, *prompts, NEW_TOKENS))
    assert len(np.unique(reference)) > 8  # not a degenerate copy of the prompt


@pytest.mark.parametrize("changes, ep", [
    (dict(strategy="ragged"), 2),
    (dict(strategy="cap_and_spill", tie_embeddings=True, **TINY_CS), 4),
    (dict(strategy="max_counts", router="sigmoid_grouped", num_groups=4, topk_groups=2), 8),
])
def test_linen_nnx_and_reference_agree(changes, ep, prompts):
    cfg = BASE.replace(**changes)
    params = init_params(jax.random.key(5), cfg)
    mesh = mesh_of(ep)
    tokens, mask = prompts
    batch, length = tokens.shape
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    valid = np.concatenate([mask, np.ones((batch, cfg.max_len - length), bool)], axis=1)
    args = (jnp.asarray(tokens), jnp.asarray(positions), init_cache(cfg, batch), jnp.int32(0),
            jnp.asarray(valid))
    ref = jax.jit(lambda p, *a: forward(p, *a, cfg, mesh))(params, *args)

    linen = MixtralLinen(cfg, mesh)
    init_tree = jax.eval_shape(lambda: linen.init(jax.random.key(1), *args)["params"])
    assert jax.tree.structure(nn.meta.unbox(init_tree)) == jax.tree.structure(params)
    out_linen = jax.jit(lambda p, *a: linen.apply({"params": p}, *a))(params, *args)

    model = nnx_load_params(MixtralNnx(cfg, mesh=mesh, rngs=nnx.Rngs(1)), params)
    graphdef, state = nnx.split(model)
    out_nnx = jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))(state, *args)
    for out in (out_linen, out_nnx):
        np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(ref.logits))
        np.testing.assert_array_equal(np.asarray(out.cache.k), np.asarray(ref.cache.k))
    back = nnx_params(model)
    jax.tree.map(np.testing.assert_array_equal, back, params)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
@pytest.mark.parametrize("strategy", ["dense", "max_counts", "cap_and_spill", "ragged"])
def test_every_strategy_and_ep_size_generates_the_same_tokens(strategy, ep, params, prompts,
                                                              reference):
    cfg = BASE.replace(strategy=strategy, **(TINY_CS if strategy == "cap_and_spill" else {}))
    result = generate(MixtralLinen(cfg, mesh_of(ep)), params, *prompts,
                      max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(result.tokens, reference)
    batch, length = prompts[0].shape
    rows_per_layer = BASE.moe.top_k * batch * (length + NEW_TOKENS - 1)
    assert int(result.stats.rows) == BASE.num_layers * rows_per_layer
    if strategy == "cap_and_spill":
        assert int(result.stats.spilled_rows) > 0 and int(result.stats.spill_steps) > 0
        assert int(result.stats.overflow_rows) > 0 and int(result.stats.fallback_steps) > 0


def test_nnx_generates_the_same_tokens(params, prompts, reference):
    cfg = BASE.replace(strategy="cap_and_spill", **TINY_CS)
    model = nnx_load_params(MixtralNnx(cfg, mesh=mesh_of(4), rngs=nnx.Rngs(3)), params)
    result = generate(model, None, *prompts, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(result.tokens, reference)
    assert int(result.stats.fallback_steps) > 0


def test_recorded_traces_calibrate_capacities(params, prompts, reference, tmp_path):
    mesh = mesh_of(4)
    result = generate(MixtralLinen(BASE.replace(strategy="ragged"), mesh), params, *prompts,
                      max_new_tokens=NEW_TOKENS, record_traces=True)
    np.testing.assert_array_equal(result.tokens, reference)
    traces = result.traces
    assert len(traces) == BASE.num_layers * NEW_TOKENS
    batch, length = prompts[0].shape
    assert traces[0].num_tokens == batch * length and traces[-1].num_tokens == batch
    assert {t.num_ranks for t in traces} == {4}
    # The recorded routing is the routing the layer dispatched.
    counts = per_peer_counts(traces)
    assert counts.sum() == int(result.stats.rows)
    assert counts.max() == int(result.stats.max_peer_rows)

    path = tmp_path / "routing.jsonl"
    save_jsonl(traces, path)
    loaded = load_jsonl(path)
    assert all(a == b for a, b in zip(loaded, traces)) and len(loaded) == len(traces)
    calib = mj.calibrate(loaded, quantile=0.5)
    assert 1 <= calib.capacity <= counts.max() and calib.spill_capacity >= 1
    cfg = BASE.replace(strategy="cap_and_spill", capacity=calib.capacity,
                       spill_capacity=calib.spill_capacity)
    again = generate(MixtralLinen(cfg, mesh), params, *prompts, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(again.tokens, reference)
    assert int(again.stats.spilled_rows) > 0  # q=0.5 leaves pairs above C


@pytest.fixture(scope="module")
def bf16_reference(params, prompts):
    cfg = BASE.replace(dtype=jax.numpy.bfloat16)
    return generate(MixtralLinen(cfg), params, *prompts, max_new_tokens=NEW_TOKENS).tokens


def test_bfloat16_activations_generate_the_same_tokens(params, prompts, bf16_reference):
    cfg = BASE.replace(dtype=jax.numpy.bfloat16, strategy="cap_and_spill",
                       transport="custom_call", **TINY_CS)
    result = generate(MixtralLinen(cfg, mesh_of(8)), params, *prompts, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(result.tokens, bf16_reference)


def test_generation_compiles_once_per_configuration(params, prompts):
    from moe_jax.models.generate import _compiled, _LinenApply
    model = MixtralLinen(BASE.replace(strategy="max_counts"), mesh_of(2))
    first = generate(model, params, *prompts, max_new_tokens=NEW_TOKENS)
    other = (np.roll(prompts[0], 1, axis=0), np.roll(prompts[1], 1, axis=0))
    second = generate(MixtralLinen(BASE.replace(strategy="max_counts"), mesh_of(2)), params,
                      *other, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(second.tokens, np.roll(first.tokens, 1, axis=0))
    run = _compiled(_LinenApply(model), model.cfg, NEW_TOKENS, False, False)
    assert run._cache_size() == 1


def test_progress_reports_do_not_recompile(params, prompts):
    from moe_jax.models.generate import _compiled, _LinenApply
    model = MixtralLinen(BASE.replace(strategy="ragged"), mesh_of(2))
    seen = []
    for _ in range(2):  # a fresh callback each time, as a fresh progress bar would be
        steps = []
        generate(model, params, *prompts, max_new_tokens=NEW_TOKENS, on_step=steps.append)
        seen.append(sorted(set(steps)))
    assert seen == [list(range(1, NEW_TOKENS))] * 2
    run = _compiled(_LinenApply(model), model.cfg, NEW_TOKENS, False, True)
    assert run._cache_size() == 1

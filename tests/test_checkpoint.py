"""Checkpoints of the example decoder: saved on 4 ranks, restored onto 2 and 8
with resharded expert weights, generating the same tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from moe_jax.checkpoint import load_config, restore_params, save_params
from moe_jax.models import DecoderConfig, MixtralLinen, MixtralNnx, init_params, nnx_load_params
from moe_jax.models.generate import generate, pad_prompts
from moe_testing import mesh_of

CFG = DecoderConfig.create(vocab_size=64, d_model=32, num_heads=4, num_layers=2,
                           num_experts=8, top_k=2, ffn_size=64, max_len=16, strategy="ragged")
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return pad_prompts([rng.integers(1, CFG.vocab_size, size=n).tolist()
                        for n in (4, 2, 5, 5, 1, 3, 5, 2)])


@pytest.fixture(scope="module")
def saved(tmp_path_factory, prompts):
    """Params saved from a 4-rank mesh, and the tokens they generate there."""
    mesh = mesh_of(4)
    params = init_params(jax.random.key(7), CFG)
    expected = generate(MixtralLinen(CFG, mesh), params, *prompts,
                        max_new_tokens=NEW_TOKENS).tokens
    directory = tmp_path_factory.mktemp("ckpt") / "decoder"
    save_params(directory, params, CFG, mesh=mesh)
    return directory, params, expected


@pytest.mark.parametrize("ep", [2, 8])
def test_restore_onto_another_ep_size(saved, prompts, ep):
    directory, params, expected = saved
    mesh = mesh_of(ep)
    restored = restore_params(directory, CFG, mesh)
    w = restored["layers_0"]["moe"]["w_gate_up"]
    assert w.sharding.mesh.shape["ep"] == ep and w.sharding.spec == P("ep")
    assert len(w.addressable_shards) == ep
    assert w.addressable_shards[0].data.shape[0] == CFG.moe.num_experts // ep
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 restored, params)
    tokens = generate(MixtralLinen(CFG, mesh), restored, *prompts,
                      max_new_tokens=NEW_TOKENS).tokens
    np.testing.assert_array_equal(tokens, expected)


def test_restore_into_nnx_with_saved_config(saved, prompts):
    directory, _, expected = saved
    cfg = load_config(directory)
    assert cfg == CFG
    mesh = mesh_of(8)
    cfg = cfg.replace(strategy="cap_and_spill", capacity=1, spill_capacity=1)
    model = nnx_load_params(MixtralNnx(cfg, mesh=mesh, rngs=nnx.Rngs(0)),
                            restore_params(directory, cfg, mesh))
    result = generate(model, None, *prompts, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(result.tokens, expected)


def test_config_json_round_trip_and_flat_layout(tmp_path):
    import json
    from moe_jax.checkpoint import _config_json
    cfg = CFG.replace(strategy="cap_and_spill", capacity=3, spill_capacity=2,
                      dtype=jnp.bfloat16, tie_embeddings=True, data_axes=("data",))
    (tmp_path / "decoder_config.json").write_text(json.dumps(_config_json(cfg)))
    assert load_config(tmp_path) == cfg
    flat = {k: v for k, v in _config_json(cfg).items() if k != "moe"}
    flat.update({("d_model" if k == "hidden_size" else k): v
                 for k, v in _config_json(cfg)["moe"].items()})
    (tmp_path / "decoder_config.json").write_text(json.dumps(flat))
    assert load_config(tmp_path) == cfg
    assert load_config(tmp_path / "missing") is None


def test_restore_rejects_mismatched_config(saved, tmp_path):
    directory, _, _ = saved
    with pytest.raises(ValueError, match="d_model"):
        restore_params(directory, CFG.replace(d_model=64), mesh_of(2))
    with pytest.raises(ValueError, match="moe.num_experts"):
        restore_params(directory, CFG.replace(num_experts=4), mesh_of(2))
    with pytest.raises(ValueError, match="directory"):
        restore_params(tmp_path / "missing", CFG)


def test_restore_checkpoint_with_separate_gate_and_up(tmp_path):
    """A checkpoint written before gate and up were fused ([E, D, F] w_gate
    and w_up) restores into the fused w_gate_up, resharded."""
    from moe_jax.ops.grouped_matmul import split_gate_up

    params = init_params(jax.random.key(3), CFG)
    legacy = jax.tree.map(lambda a: a, params)
    for name in ("layers_0", "layers_1"):
        moe = dict(legacy[name]["moe"])
        moe["w_gate"], moe["w_up"] = split_gate_up(moe.pop("w_gate_up"))
        legacy[name] = dict(legacy[name], moe=moe)
    directory = save_params(tmp_path / "legacy", legacy, CFG, mesh=mesh_of(4))
    restored = restore_params(directory, CFG, mesh_of(2))
    fused = restored["layers_1"]["moe"]["w_gate_up"]
    assert fused.sharding.spec == P("ep") and fused.sharding.mesh.shape["ep"] == 2
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 restored, params)

"""Example models built on moe_jax: a small Mixtral-style decoder and greedy generation."""

from moe_jax.models.decoder import (EXPERT_PARAM_NAMES, DecoderConfig, KVCache, MixtralLinen,
                                    MixtralNnx, ModelOutput, forward, init_cache, init_params,
                                    linen_stats, nnx_load_params, nnx_params)

__all__ = [
    "EXPERT_PARAM_NAMES", "DecoderConfig", "KVCache", "MixtralLinen", "MixtralNnx",
    "ModelOutput", "forward", "init_cache", "init_params", "linen_stats", "nnx_load_params",
    "nnx_params",
]

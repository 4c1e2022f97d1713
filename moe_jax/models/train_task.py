"""A small synthetic next-token task for training the example decoder.

A noisy bigram language: a fixed random permutation `perm` of the
vocabulary; each sequence starts at a random token, and each next token is
`perm[previous]` with probability 1 - noise, else a uniform random token.
A model that learns `perm` reaches a cross-entropy near the noise floor
(`noise_floor`), far below the log(V) of a uniform guess, so a falling loss
is easy to see in a few hundred steps. Batches are a function of (seed,
step) alone, drawn on the host with NumPy: every strategy, variant and mesh
trains on the same tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class BigramTask(NamedTuple):
    """vocab_size V; seq_len S (tokens per input); noise: probability of a
    random next token; seed: fixes the permutation and every batch."""

    vocab_size: int
    seq_len: int
    noise: float = 0.1
    seed: int = 0

    def perm(self) -> np.ndarray:
        return np.random.default_rng(self.seed).permutation(self.vocab_size)

    def batch(self, step: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets): int32 [batch_size, S] each, targets the next tokens."""
        rng = np.random.default_rng((self.seed, step))
        perm = self.perm()
        tokens = np.empty((batch_size, self.seq_len + 1), np.int64)
        tokens[:, 0] = rng.integers(0, self.vocab_size, batch_size)
        random_next = rng.random((batch_size, self.seq_len)) < self.noise
        uniform = rng.integers(0, self.vocab_size, (batch_size, self.seq_len))
        for i in range(self.seq_len):
            tokens[:, i + 1] = np.where(random_next[:, i], uniform[:, i], perm[tokens[:, i]])
        tokens = tokens.astype(np.int32)
        return tokens[:, :-1], tokens[:, 1:]

    def noise_floor(self) -> float:
        """Cross-entropy (nats) of the true next-token distribution."""
        v, p = self.vocab_size, self.noise
        right = 1 - p + p / v
        wrong = p / v
        return -(right * math.log(right) + (v - 1) * wrong * math.log(wrong))


def lm_loss(logits: jax.Array, targets: jax.Array,
            mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """Mean next-token cross-entropy: logits [B, S, V] float32, targets [B, S] int.

    With a mesh the per-token terms are gathered before the mean, so its sum
    runs in one order whatever layout the logits had (programs that differ
    elsewhere, e.g. in their MoE strategy, report the same bits)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)
    if mesh is not None:
        picked = jax.lax.with_sharding_constraint(
            picked, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return -jnp.mean(picked)


def full_sequence_inputs(cfg, inputs: jax.Array):
    """(positions [B, S], index 0, kv_valid [B, max_len]) for a whole
    sequence per row (training: max_len = S, every slot valid)."""
    batch, length = inputs.shape
    if cfg.max_len != length:
        raise ValueError(f"inputs: {length} tokens per sequence, but the decoder's max_len "
                         f"is {cfg.max_len}; build the config with max_len={length}")
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return positions, jnp.zeros((), jnp.int32), jnp.ones((batch, cfg.max_len), bool)

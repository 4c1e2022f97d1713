"""Flax modules wrapping the MoE layer: `linen.MoE` and `nnx.MoE`."""

"""Operators behind the MoE layer, one module per op family, each beside its
pure-JAX reference: `moe_jax.ops.grouped_matmul` (the experts' GEMMs)."""

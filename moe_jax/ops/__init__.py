"""Operators behind the MoE layer: one FFI layer (`moe_jax.ops.ffi`) and one
module per op family, each beside its pure-JAX reference: `pack_combine`,
`all_to_all`, `grouped_matmul` (the experts' GEMMs)."""

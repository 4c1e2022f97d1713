"""moe_jax's XLA FFI custom calls, by their public names.

The implementations live in `moe_jax.ops`, one module per op family behind
one FFI layer (`moe_jax.ops.ffi`): `pack_combine`, `all_to_all`,
`grouped_matmul`; plus `moe_jax.row_invariant`, `moe_jax.nvlink` and
`moe_jax.fast.staged_ffi`. Semantics: docs/design/custom_calls.md;
pure-JAX references: moe_jax/refs.py. Shapes and dtypes are validated at
trace time, naming the offending operand; every wrapper takes `impl`
("custom_call" or "reference", identical bits) and is differentiable.
"""

from moe_jax.ops.all_to_all import (ALL_TO_ALL, NCCL_ALL_TO_ALL, all_to_all,  # noqa: F401
                                    nccl_all_to_all, ragged_all_to_all)
from moe_jax.ops.ffi import (FLOAT_DTYPES, available_platforms, register,  # noqa: F401
                             replica_groups)
from moe_jax.ops.pack_combine import COMBINE, PACK, combine, pack  # noqa: F401

register()

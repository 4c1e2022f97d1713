"""The staged all-to-all as one CUDA custom call (NCCL on XLA's communicator).

``moe_jax_fast_staged_all_to_all`` (cuda/fast_staged_all_to_all.cc):

  operands  x [R, ...] (any whole-byte dtype), traffic int32[P, P]
            (effective traffic, the same on every rank)
  results   out [R_out, ...] x.dtype, workspace [W, ...] x.dtype
  attrs     replica_groups, group_size, communication_id (as
            moe_jax_nccl_all_to_all), num_servers, gpus_per_server

The execute stage copies ``traffic`` to the host and waits for XLA's
stream, runs the C++ FAST scheduler and planner (xla_ffi/fast), zeroes the
out rows past what this rank receives and issues every phase as one
ncclGroupStart/End of ncclSend/ncclRecv (local rows: cudaMemcpyAsync).

Not graph-capturable (a device-to-host copy and a host sync every call):
the handler does not claim command-buffer compatibility, so XLA keeps it
out of CUDA graphs.
"""

from __future__ import annotations

import jax
import numpy as np

from moe_jax.ops import ffi
from moe_jax.fast.topology import Topology

TARGET = "moe_jax_fast_staged_all_to_all"


def available() -> bool:
  """Whether this installation registered the CUDA handler."""
  return TARGET in ffi.register().get("CUDA", ())


def ffi_all_to_all(x, traffic, *, axis_name: str, topology: Topology,
                   out_rows: int, ws_rows: int):
  """[out_rows, ...] x.dtype: the staged all-to-all, inside shard_map on GPUs."""
  ffi.require_handlers(TARGET, "gpu")
  groups = ffi.replica_groups(axis_name)
  tail = tuple(x.shape[1:])
  out_types = (jax.ShapeDtypeStruct((out_rows,) + tail, x.dtype),
               jax.ShapeDtypeStruct((ws_rows,) + tail, x.dtype))
  attrs = dict(replica_groups=groups.reshape(-1),
               group_size=np.int64(groups.shape[1]),
               communication_id=np.int64(0),
               num_servers=np.int64(topology.num_servers),
               gpus_per_server=np.int64(topology.gpus_per_server))
  out, _ = ffi.call_ffi(TARGET, out_types, (x, traffic), attrs,
                                  extra_axes=(axis_name,), has_side_effect=True)
  return out

"""Count-aware NVLink dispatch and combine (CUDA custom calls).

Senders store each token once into the persistent buffer of every GPU that
one of its picks lives on (over NVLink) with an index entry per (token,
pick), and raise a device-side flag; receivers wait on the flags on the
device and expand the index into one row per pick as they group the rows by
expert. Combine returns one row per (token, pick) and sums them in pick
order at the source. Only the rows that exist cross the link, the
counts never leave the device, shapes stay static and nothing synchronizes
with the host, so every call is graph-capturable.

`dispatch` and `combine` run both halves in one custom call. The halves are
also exposed alone (`dispatch_send` / `dispatch_recv`, `combine_send` /
`combine_recv`) so that work placed between them (a shared expert, say)
overlaps the transfer; then each receive must follow its send before the
channel's next send-after-next: XLA may reorder calls that do not depend on
each other (e.g. across unrolled loop iterations), so use the halves where
the program fixes their order, and the fused calls elsewhere. A rank that
waits more than 30 s for a peer traps with a message naming the wait.

Receive buffers belong to a channel: one per (devices of the expert group,
T, k, E_local, H * itemsize, dispatch format), allocated once on every GPU
of the group (2 x P x T dispatched rows and 2 x P x T x min(k, E_local)
returned rows per GPU) and shared by every call of that signature. At most
two sends per channel may be outstanding (each half alternates between two
buffers). One GPU per rank, all ranks of a group with peer access (one
NVLink domain, P <= 8).

Multi-process meshes (jax.distributed, e.g. one GPU per process): each
process allocates the buffers of its own GPUs; the members of a group
exchange their buffers' CUDA IPC handles once, by an all-gather over XLA's
NCCL communicator of the group, and map each other's buffers
(cudaIpcOpenMemHandle; the plain pointer for GPUs of the same process). The
exchange runs in the custom call's initialize stage where XLA runs one,
else at the first execution, which must then happen outside CUDA graph
capture (an error says so otherwise). Every group must sit inside one node.

Layout of the dispatched rows: [P * W, H], W = T * min(k, E_local), grouped
by local expert and within an expert by (source rank, token, pick), the
canonical order every moe_jax strategy delivers; rows past
sum(group_sizes) are unspecified.

fp8 dispatch (`fp8=True`, bfloat16 x, H a multiple of 512) sends e4m3 rows
with one float32 scale per 128 elements (`quantize_e4m3` is the reference:
per 128-element block, value = e4m3(x * (448 / amax)) rounded to nearest
even and scale = amax * float32(1 / 448), both factors 1 for an all-zero
block) and delivers them as float8_e4m3fn
rows plus [P * W, H / 128] scales; combine stays bfloat16.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import nvlink_grad
from moe_jax.ops import ffi
from moe_jax.fp8 import FP8_BLOCK, FP8_MAX, dequantize, quantize_e4m3  # noqa: F401 (re-exported)
from moe_jax.plan import worst_case_rows_per_peer

DISPATCH = "moe_jax_nvlink_dispatch"
COMBINE = "moe_jax_nvlink_combine"
DISPATCH_SEND = "moe_jax_nvlink_dispatch_send"
DISPATCH_RECV = "moe_jax_nvlink_dispatch_recv"
COMBINE_SEND = "moe_jax_nvlink_combine_send"
COMBINE_RECV = "moe_jax_nvlink_combine_recv"
DISPATCH_FP8 = "moe_jax_nvlink_dispatch_fp8"
DISPATCH_RECV_FP8 = "moe_jax_nvlink_dispatch_recv_fp8"
MAX_RANKS = 8


class Dispatched(NamedTuple):
    """What dispatch delivers to one rank.

    rows: [P * W, H] received rows grouped by local expert (see module doc).
    group_sizes: [E_local] int32 rows per local expert.
    all_counts: [P(src), P(dst), E_local] int32 rows every source sent every
      expert (the same on every rank).
    slot_pos: [T, k] int32 stream position of this rank's picks (combine
      needs it; -1 for ids out of range, which are dropped).
    scales: fp8 dispatch only: [P * W, H / 128] float32, rows being
      float8_e4m3fn (`dequantize` gives the values); None otherwise.
    """

    rows: jax.Array
    group_sizes: jax.Array
    all_counts: jax.Array
    slot_pos: jax.Array
    scales: jax.Array | None = None


def _check(cond, operand, message):
    if not cond:
        raise ValueError(f"moe_jax_nvlink: argument '{operand}' {message}")


class GroupLayout(NamedTuple):
    """Where the members of every group live.

    device_ordinals: [G, P] int64 CUDA ordinal of each member in its own
      process (-1 where the process does not report it).
    replica_groups: [G, P] int64 flattened device ids (positions in the
      mesh's device order: XLA's partition ids), as the NCCL transport names
      its groups; they select XLA's communicator of the groups.
    multi_process: the mesh's devices span several processes.
    """

    device_ordinals: np.ndarray
    replica_groups: np.ndarray
    multi_process: bool


def _local_ordinal(device) -> int:
    ordinal = getattr(device, "local_hardware_id", None)
    return -1 if ordinal is None else int(ordinal)


def group_layout(groups: np.ndarray, mesh_devices) -> GroupLayout:
    """The layout of `groups` ([G, P] flattened device ids, rank order) over
    `mesh_devices` (the mesh's devices in mesh order, `mesh.devices.flat`),
    which may belong to several processes; each must be a GPU."""
    devices = list(mesh_devices)
    groups = np.asarray(groups, np.int64)
    _check(groups.size == len(devices), "mesh_devices",
           f"must list the {groups.size} devices of the mesh, got {len(devices)}")
    _check(groups.shape[1] <= MAX_RANKS, "axis_name",
           f"spans {groups.shape[1]} ranks; the NVLink transport takes at most {MAX_RANKS}")
    _check(all(d.platform == "gpu" for d in devices), "mesh_devices",
           "must be GPUs")
    ordinals = np.array([_local_ordinal(d) for d in devices], np.int64)
    processes = {d.process_index for d in devices}
    return GroupLayout(ordinals[groups], groups, len(processes) > 1)


def device_ordinal_groups(axis_name: str, mesh_devices) -> np.ndarray:
    """[G, P] CUDA device ordinals (each in its own process) of every group
    along `axis_name`, rank order. mesh_devices: the mesh's devices in mesh
    order (`mesh.devices.flat`)."""
    return group_layout(ffi.replica_groups(axis_name), mesh_devices).device_ordinals


class Channel(NamedTuple):
    """Static attributes naming one channel (see the module doc).

    replica_groups ([G, P] flattened device ids) and multi_process matter
    only when the mesh spans processes; replica_groups defaults to the
    groups of a 1-D mesh in device order.
    """

    device_ordinals: np.ndarray   # [G, P]
    experts_per_rank: int
    tokens: int
    top_k: int
    hidden: int
    dtype: jnp.dtype
    fp8: bool = False
    replica_groups: np.ndarray | None = None   # [G, P]
    multi_process: bool = False

    @property
    def num_ranks(self) -> int:
        return self.device_ordinals.shape[1]

    @property
    def rows(self) -> int:
        """Rows of the dispatched buffer: P * T * min(k, E_local)."""
        return self.num_ranks * worst_case_rows_per_peer(self.tokens, self.top_k,
                                                         self.experts_per_rank)

    def attrs(self) -> dict:
        groups = self.replica_groups
        if groups is None:
            groups = np.arange(self.device_ordinals.size).reshape(self.device_ordinals.shape)
        return dict(device_ordinals=self.device_ordinals.reshape(-1).astype(np.int64),
                    group_size=np.int64(self.num_ranks),
                    experts_per_rank=np.int64(self.experts_per_rank),
                    tokens=np.int64(self.tokens), top_k=np.int64(self.top_k),
                    row_bytes=np.int64(self.hidden * jnp.dtype(self.dtype).itemsize),
                    dispatch_fp8=np.int64(int(self.fp8)),
                    multi_process=np.int64(int(self.multi_process)),
                    replica_groups=np.asarray(groups, np.int64).reshape(-1))

    def dispatched_types(self) -> tuple:
        """Shapes/dtypes of the dispatched rows (and scales for fp8)."""
        if not self.fp8:
            return (jax.ShapeDtypeStruct((self.rows, self.hidden), self.dtype),)
        return (jax.ShapeDtypeStruct((self.rows, self.hidden), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((self.rows, self.hidden // FP8_BLOCK), jnp.float32))


def channel_for(x, expert_ids, *, experts_per_rank: int, axis_name: str,
                mesh_devices, fp8: bool = False) -> Channel:
    """Validates the operands (at trace time) and names their channel."""
    _check(x.ndim == 2 and x.dtype in ffi.FLOAT_DTYPES, "x",
           f"must be [T, H] float32/bfloat16/float16, got {x.dtype}{list(x.shape)}")
    _check((x.shape[1] * x.dtype.itemsize) % 16 == 0, "x",
           f"rows must be a multiple of 16 bytes, got H={x.shape[1]} of {x.dtype}")
    _check(expert_ids.ndim == 2 and expert_ids.shape[0] == x.shape[0]
           and expert_ids.dtype == jnp.int32, "expert_ids",
           f"must be int32 [T={x.shape[0]}, k], got {expert_ids.dtype}{list(expert_ids.shape)}")
    if fp8:
        _check(x.dtype == jnp.bfloat16 and x.shape[1] % 512 == 0, "x",
               f"must be bfloat16 with H a multiple of 512 for fp8 dispatch, got "
               f"{x.dtype}{list(x.shape)}")
    layout = group_layout(ffi.replica_groups(axis_name), mesh_devices)
    _check(1 <= experts_per_rank <= 256
           and layout.device_ordinals.shape[1] * experts_per_rank <= 1024,
           "experts_per_rank", f"must be in [1, 256] with P * E_local <= 1024, "
           f"got {experts_per_rank}")
    return Channel(layout.device_ordinals, int(experts_per_rank), int(x.shape[0]),
                   int(expert_ids.shape[1]), int(x.shape[1]), jnp.dtype(x.dtype), bool(fp8),
                   layout.replica_groups, layout.multi_process)


def _check_y(channel: Channel, y) -> None:
    _check(y.shape == (channel.rows, channel.hidden) and y.dtype == channel.dtype, "y",
           f"must be {channel.dtype}[{channel.rows}, {channel.hidden}] (the dispatched "
           f"layout and dtype), got {y.dtype}{list(y.shape)}")


def _check_weights(expert_ids, weights) -> None:
    _check(weights.shape == expert_ids.shape and weights.dtype == jnp.float32, "weights",
           f"must be float32 {list(expert_ids.shape)}, got {weights.dtype}{list(weights.shape)}")


def _call(target, channel: Channel, axis_name, out_types, operands, same_on_every_rank=()):
    """The custom call; results listed in same_on_every_rank stay typed as
    invariant over the mesh axes (they are), the others vary."""
    ffi.require_handlers(target, "gpu")
    return ffi.call_ffi(target, out_types, operands, channel.attrs(), extra_axes=(axis_name,),
                        invariant_results=same_on_every_rank, has_side_effect=True)


def dispatch_send(channel: Channel, x, expert_ids, *, axis_name: str):
    """First half of dispatch: rows leave for their experts' GPUs.

    Returns (slot_pos [T, k] int32, send_counts [P, E_local] int32).
    """
    p, e_local = channel.num_ranks, channel.experts_per_rank
    out_types = (jax.ShapeDtypeStruct(expert_ids.shape, jnp.int32),
                 jax.ShapeDtypeStruct((p, e_local), jnp.int32))
    return _call(DISPATCH_SEND, channel, axis_name, out_types, (x, expert_ids))


def dispatch_recv(channel: Channel, slot_pos, *, axis_name: str):
    """Second half: waits for every source.

    Returns (rows, group_sizes, all_counts), or (rows, scales, group_sizes,
    all_counts) for an fp8 channel.
    """
    p, e_local = channel.num_ranks, channel.experts_per_rank
    rows = channel.dispatched_types()
    out_types = rows + (jax.ShapeDtypeStruct((e_local,), jnp.int32),
                        jax.ShapeDtypeStruct((p, p, e_local), jnp.int32))
    target = DISPATCH_RECV_FP8 if channel.fp8 else DISPATCH_RECV
    return _call(target, channel, axis_name, out_types, (slot_pos,),
                 same_on_every_rank=(len(rows) + 1,))


def combine_send(channel: Channel, y, all_counts, *, axis_name: str):
    """First half of combine: expert outputs y (dispatched layout) go home.

    Returns a token to hand to combine_recv.
    """
    _check_y(channel, y)
    out_type = jax.ShapeDtypeStruct((1,), jnp.int32)
    return _call(COMBINE_SEND, channel, axis_name, out_type, (y, all_counts))


def combine_recv(channel: Channel, done, expert_ids, slot_pos, weights, *, axis_name: str):
    """Second half: out[t] = sum_j weights[t, j] * expert output of (t, j).

    Float32 accumulation in pick order (as moe_jax_combine), stored in the
    dispatched dtype. Returns [T, H].
    """
    _check_weights(expert_ids, weights)
    out_type = jax.ShapeDtypeStruct((channel.tokens, channel.hidden), channel.dtype)
    return _call(COMBINE_RECV, channel, axis_name, out_type,
                 (done, expert_ids, slot_pos, weights))


def _dispatch_call(channel: Channel, x, expert_ids, *, axis_name: str) -> Dispatched:
    """The fused dispatch custom call on `channel` (no gradient)."""
    p, e_local = channel.num_ranks, channel.experts_per_rank
    rows = channel.dispatched_types()
    out_types = ((jax.ShapeDtypeStruct(expert_ids.shape, jnp.int32),
                  jax.ShapeDtypeStruct((p, e_local), jnp.int32)) + rows
                 + (jax.ShapeDtypeStruct((e_local,), jnp.int32),
                    jax.ShapeDtypeStruct((p, p, e_local), jnp.int32)))
    target = DISPATCH_FP8 if channel.fp8 else DISPATCH
    results = _call(target, channel, axis_name, out_types, (x, expert_ids),
                    same_on_every_rank=(len(out_types) - 1,))
    slot_pos, group_sizes, all_counts = results[0], results[-2], results[-1]
    scales = results[3] if channel.fp8 else None
    return Dispatched(results[2], group_sizes, all_counts, slot_pos, scales)


def _combine_call(channel: Channel, y, all_counts, expert_ids, slot_pos, weights, *,
                  axis_name: str):
    """The fused combine custom call on `channel` (no gradient)."""
    _check_y(channel, y)
    _check_weights(expert_ids, weights)
    out_type = jax.ShapeDtypeStruct((channel.tokens, channel.hidden), channel.dtype)
    return _call(COMBINE, channel, axis_name, out_type,
                 (y, all_counts, expert_ids, slot_pos, weights))


class ChannelOps(NamedTuple):
    """The fused calls of one expert group (nvlink_grad.CountAwareOps).

    `channel` serves rows of its own width and dtype (and its dispatch
    format); rows of another width or dtype (the backward's output gradient
    of an fp8 channel, the float32 side rows of the weights) go through the
    channel of the same group and (T, k, E_local) for that row format,
    allocated like any other on first use.
    """

    channel: Channel
    axis_name: str

    @property
    def experts_per_rank(self) -> int:
        return self.channel.experts_per_rank

    def _same_rows(self, rows) -> bool:
        return rows.shape[1] == self.channel.hidden and rows.dtype == self.channel.dtype

    def _other(self, rows, fp8: bool = False) -> Channel:
        return self.channel._replace(hidden=int(rows.shape[1]), dtype=jnp.dtype(rows.dtype),
                                     fp8=bool(fp8))

    def dispatch(self, x, expert_ids, *, fp8: bool = False) -> Dispatched:
        same = self._same_rows(x) and fp8 == self.channel.fp8
        channel = self.channel if same else self._other(x, fp8)
        return _dispatch_call(channel, x, expert_ids, axis_name=self.axis_name)

    def combine(self, y, all_counts, expert_ids, slot_pos, weights):
        # An fp8 channel combines rows of its token dtype: it serves those.
        channel = self.channel if self._same_rows(y) else self._other(y)
        return _combine_call(channel, y, all_counts, expert_ids, slot_pos, weights,
                             axis_name=self.axis_name)


def dispatch(x, expert_ids, *, experts_per_rank: int, axis_name: str,
             mesh_devices, fp8: bool = False) -> tuple[Channel, Dispatched]:
    """Both halves of dispatch, inside `jax.shard_map` over `axis_name`.

    Args:
      x: [T, H] float32/bfloat16/float16 tokens of this rank; H * itemsize a
        multiple of 16 bytes.
      expert_ids: [T, k] int32 global expert ids, distinct per token.
      experts_per_rank: E_local (global expert e lives on rank e // E_local).
      mesh_devices: the mesh's devices in mesh order.
      fp8: send e4m3 rows with per-128 scales (bfloat16 x, H % 512 == 0).
    Returns (channel, Dispatched). Graph-capturable. Differentiable in x
    (moe_jax/nvlink_grad.py: the VJP combines the rows' gradients home with
    unit weights) except with fp8, whose e4m3 rows have no gradient; use
    `dispatch_dequantized` for a straight-through one.
    """
    channel = channel_for(x, expert_ids, experts_per_rank=experts_per_rank,
                          axis_name=axis_name, mesh_devices=mesh_devices, fp8=fp8)
    if fp8:
        return channel, _dispatch_call(channel, x, expert_ids, axis_name=axis_name)
    return channel, nvlink_grad.dispatch(ChannelOps(channel, axis_name), x, expert_ids)


def dispatch_dequantized(x, expert_ids, *, experts_per_rank: int, axis_name: str,
                         mesh_devices, fp8: bool = False) -> tuple[Channel, Dispatched]:
    """`dispatch` whose rows come back in x's dtype: with fp8 dequantized
    (`dequantize`), scales None. Differentiable in x; with fp8 the gradient
    passes the quantization as the identity (straight-through).
    Graph-capturable."""
    channel = channel_for(x, expert_ids, experts_per_rank=experts_per_rank,
                          axis_name=axis_name, mesh_devices=mesh_devices, fp8=fp8)
    return channel, nvlink_grad.dispatch(ChannelOps(channel, axis_name), x, expert_ids, fp8=fp8)


def combine(channel: Channel, y, dispatched: Dispatched, expert_ids, weights, *,
            axis_name: str):
    """Both halves of combine: [T, H] in the dispatched dtype. Graph-capturable.

    Differentiable in y and weights (moe_jax/nvlink_grad.py): the backward
    dispatches the output gradient (and each token's weights and ids as a
    float32 side row) to the rows' ranks, and combines the weights'
    gradients home.
    """
    _check_y(channel, y)
    _check_weights(expert_ids, weights)
    return nvlink_grad.combine(ChannelOps(channel, axis_name), y, dispatched, expert_ids,
                               weights)

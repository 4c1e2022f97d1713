"""Pure-JAX reference of the fused NVLink dispatch and combine.

`ReferenceOps` computes inside `jax.shard_map` over the expert axis what the
kernels of moe_jax/nvlink.py compute (the same Dispatched layout and
combine arithmetic) from all-gathers and gathers, on any backend. It
implements nvlink_grad.CountAwareOps, so the NVLink transport's gradient
rules run and are tested on CPU with it; it moves every rank's tokens to
every rank and is meant for tests, not speed.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.fp8 import quantize_e4m3
from moe_jax.nvlink import Dispatched
from moe_jax.plan import exclusive_cumsum, worst_case_rows_per_peer
from moe_jax.rounding import as_float32


class ReferenceOps(NamedTuple):
    """axis_name: the expert axis; num_ranks: P; experts_per_rank: E_local."""

    axis_name: str
    num_ranks: int
    experts_per_rank: int

    def _rank(self) -> jax.Array:
        return jax.lax.axis_index(self.axis_name).astype(jnp.int32)

    def _send_plan(self, expert_ids):
        """(slot_pos [T, k], send_expert_counts [P, E_local]) of this rank."""
        num_experts = self.num_ranks * self.experts_per_rank
        flat = expert_ids.reshape(-1).astype(jnp.int32)
        valid = (flat >= 0) & (flat < num_experts)
        key = jnp.where(valid, flat, num_experts)
        num_slots = flat.shape[0]
        order = jnp.argsort(key, stable=True)
        rank_in_order = jnp.zeros((num_slots,), jnp.int32).at[order].set(
            jnp.arange(num_slots, dtype=jnp.int32))
        counts = jnp.zeros((num_experts,), jnp.int32).at[key].add(1, mode="drop")
        send_expert_counts = counts.reshape(self.num_ranks, self.experts_per_rank)
        send_offsets = exclusive_cumsum(jnp.sum(send_expert_counts, axis=1))
        dest = jnp.where(valid, flat // self.experts_per_rank, 0)
        slot_pos = jnp.where(valid, rank_in_order - send_offsets[dest], -1)
        return slot_pos.reshape(expert_ids.shape).astype(jnp.int32), send_expert_counts

    def dispatch(self, x, expert_ids, *, fp8: bool = False) -> Dispatched:
        """x [T, H] -> Dispatched (rows past sum(group_sizes) are zero)."""
        num_tokens, top_k = expert_ids.shape
        num_local = self.experts_per_rank
        slot_pos, send_expert_counts = self._send_plan(expert_ids)
        all_counts = jax.lax.all_gather(send_expert_counts, self.axis_name)  # [src, dst, E_l]
        x_all = jax.lax.all_gather(x, self.axis_name).reshape((-1,) + x.shape[1:])
        ids_all = jax.lax.all_gather(expert_ids.astype(jnp.int32),
                                     self.axis_name).reshape(-1)      # (src, t, j) order
        mine = ((ids_all >= 0) & (ids_all < self.num_ranks * num_local)
                & (ids_all // num_local == self._rank()))
        local = jnp.where(mine, ids_all % num_local, num_local)
        num_rows = self.num_ranks * worst_case_rows_per_peer(num_tokens, top_k, num_local)
        take = jnp.argsort(local, stable=True)[:num_rows]
        rows = jnp.where(mine[take][:, None], x_all[take // top_k], jnp.zeros((), x.dtype))
        group_sizes = jnp.zeros((num_local,), jnp.int32).at[local].add(1, mode="drop")
        scales = None
        if fp8:
            rows, scales = quantize_e4m3(rows)
        return Dispatched(rows, group_sizes, all_counts, slot_pos, scales)

    def combine(self, y, all_counts, expert_ids, slot_pos, weights):
        """y [R, H] (this rank's rows, dispatched layout) -> [T, H] in y's
        dtype: float32 sum in pick order of weight x row, no FMA."""
        num_tokens, top_k = expert_ids.shape
        num_local = self.experts_per_rank
        ids = expert_ids.astype(jnp.int32)
        present = slot_pos >= 0
        dest = jnp.where(present, ids // num_local, 0)
        local = jnp.where(present, ids % num_local, 0)
        counts = jnp.swapaxes(all_counts, 0, 1)                  # [dst, src, E_local]
        expert_offset = exclusive_cumsum(jnp.sum(counts, axis=1), axis=1)    # [dst, E_l]
        src_offset = exclusive_cumsum(counts, axis=1)[:, self._rank()]      # [dst, E_l]
        stream_start = exclusive_cumsum(counts[:, self._rank()], axis=1)    # [dst, E_l]
        index = (expert_offset[dest, local] + src_offset[dest, local]
                 + slot_pos - stream_start[dest, local])
        y_all = jax.lax.all_gather(y, self.axis_name)                       # [dst, R, H]
        rows = as_float32(y_all[dest, jnp.clip(index, 0, y.shape[0] - 1)])
        acc = jnp.zeros((num_tokens,) + y.shape[1:], jnp.float32)
        for j in range(top_k):
            term = jnp.where(present[:, j, None], weights[:, j, None] * rows[:, j],
                             jnp.float32(0))
            # The barrier keeps XLA from contracting multiply and add into an FMA.
            acc = acc + jax.lax.optimization_barrier(term)
        return acc.astype(y.dtype)

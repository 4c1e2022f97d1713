"""Where a strategy runs: its rank group, transport and kernel implementation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax import custom_calls


@dataclasses.dataclass(frozen=True)
class DispatchContext:
    """Static facts a strategy needs while tracing.

    axis_name: the expert mesh axis (None when there is one rank).
    num_ranks: P, ranks along axis_name.
    transport: "lax" (XLA collectives) or "custom_call" (moe_jax's own:
      the in-process all-to-all on CPU, NCCL on XLA's communicator on GPU).
    kernel_impl: "custom_call" or "reference" for pack / combine.
    platform: "cpu" or "gpu" (the platform the program is compiled for).
    """

    axis_name: str | None
    num_ranks: int
    transport: str = "lax"
    kernel_impl: str = "custom_call"
    platform: str = "cpu"

    def all_to_all(self, x: jax.Array) -> jax.Array:
        """[P, C, ...] blocks: result[src] = x@src[rank]. Identity for one rank."""
        if self.axis_name is None or self.num_ranks == 1:
            return x
        if self.transport == "custom_call":
            if self.platform != "cpu":
                return custom_calls.nccl_all_to_all(x, axis_name=self.axis_name)[0]
            return custom_calls.all_to_all(x, axis_name=self.axis_name)
        return jax.lax.all_to_all(x, self.axis_name, 0, 0, tiled=False)

    def all_to_all_many(self, buffers: list[jax.Array]) -> list[jax.Array]:
        """all_to_all of several [P, C_i, ...] buffers; on GPU with transport
        "custom_call", one NCCL group carries them all (one latency)."""
        if self.axis_name is None or self.num_ranks == 1:
            return list(buffers)
        if self.transport == "custom_call" and self.platform != "cpu":
            live = [b for b in buffers if b.size]
            moved = iter(custom_calls.nccl_all_to_all(*live, axis_name=self.axis_name)) \
                if live else iter(())
            return [next(moved) if b.size else b for b in buffers]
        return [self.all_to_all(b) for b in buffers]

    def ragged_all_to_all(self, send, send_offsets, send_sizes, recv_offsets, recv_rows):
        """Moves only real rows; see custom_calls.ragged_all_to_all.

        recv_offsets are this rank's own (where rows from each source land).
        Uses lax.ragged_all_to_all on GPU (whatever the transport: moving
        exact sizes with NCCL would need the counts on the host), and on CPU
        the custom call (XLA:CPU does not implement lax.ragged_all_to_all).
        """
        if self.axis_name is None or self.num_ranks == 1:
            out = jnp.zeros((recv_rows,) + send.shape[1:], send.dtype)
            rows = min(recv_rows, send.shape[0])
            mask = (jnp.arange(rows) < send_sizes[0]).reshape((rows,) + (1,) * (send.ndim - 1))
            return out.at[:rows].set(jnp.where(mask, send[:rows], 0)), send_sizes
        if self.platform != "cpu":
            # Each sender must name where its rows land on every receiver.
            output_offsets = jax.lax.all_to_all(recv_offsets, self.axis_name, 0, 0, tiled=True)
            recv_sizes = jax.lax.all_to_all(send_sizes, self.axis_name, 0, 0, tiled=True)
            out = jnp.zeros((recv_rows,) + send.shape[1:], send.dtype)
            out = jax.lax.ragged_all_to_all(send, out, send_offsets, send_sizes,
                                            output_offsets, recv_sizes, axis_name=self.axis_name)
            return out, recv_sizes
        impl = "reference" if self.kernel_impl == "reference" and self.transport != \
            "custom_call" else "custom_call"
        return custom_calls.ragged_all_to_all(send, send_offsets, send_sizes, recv_offsets,
                                              recv_rows=recv_rows, axis_name=self.axis_name,
                                              impl=impl)

    def psum(self, x):
        return x if self.axis_name is None else jax.lax.psum(x, self.axis_name)

    def pmax(self, x):
        return x if self.axis_name is None else jax.lax.pmax(x, self.axis_name)

    def pack(self, *args, **kwargs):
        return custom_calls.pack(*args, impl=self.kernel_impl, platform=self.platform, **kwargs)

    def combine(self, *args, **kwargs):
        return custom_calls.combine(*args, impl=self.kernel_impl, platform=self.platform,
                                    **kwargs)

"""Where a strategy runs: its rank group, transport and kernel implementation."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moe_jax import custom_calls, manual_axes
from moe_jax.fast import transport as fast_transport
from moe_jax.ordering import depend_on, opaque_zero


def xla_ragged_all_to_all(send, send_offsets, send_sizes, recv_offsets, recv_rows, axis_name):
    """`lax.ragged_all_to_all` with receiver-side offsets (see
    custom_calls.ragged_all_to_all for the arguments): (recv [recv_rows,
    ...], recv_sizes [P]). Rows nobody wrote are zero. GPU only.

    Its VJP is the reverse exchange written out here (d_recv's ranges go
    back to the rows they came from, rows sent nowhere get zero), the same
    operation as the forward with offsets and sizes swapped.
    """
    operands = manual_axes.same_varying(send, send_offsets, send_sizes, recv_offsets,
                                        extra_axes=(axis_name,))
    return _xla_ragged(send.shape[0], recv_rows, axis_name, *operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _xla_ragged(send_rows, recv_rows, axis_name, send, send_offsets, send_sizes, recv_offsets):
    del send_rows
    # Each sender must name where its rows land on every receiver.
    output_offsets = jax.lax.all_to_all(recv_offsets, axis_name, 0, 0, tiled=True)
    recv_sizes = jax.lax.all_to_all(send_sizes, axis_name, 0, 0, tiled=True)
    out = manual_axes.as_varying(jnp.zeros((recv_rows,) + send.shape[1:], send.dtype),
                                 manual_axes.varying_axes(send))
    out = jax.lax.ragged_all_to_all(send, out, send_offsets, send_sizes, output_offsets,
                                    recv_sizes, axis_name=axis_name)
    return out, recv_sizes


def _xla_ragged_fwd(send_rows, recv_rows, axis_name, send, send_offsets, send_sizes,
                    recv_offsets):
    out, recv_sizes = _xla_ragged(send_rows, recv_rows, axis_name, send, send_offsets,
                                  send_sizes, recv_offsets)
    return (out, recv_sizes), (send_offsets, recv_offsets, recv_sizes)


def _xla_ragged_bwd(send_rows, recv_rows, axis_name, residuals, cotangents):
    send_offsets, recv_offsets, recv_sizes = residuals
    d_send, _ = _xla_ragged(recv_rows, send_rows, axis_name, cotangents[0], recv_offsets,
                            recv_sizes, send_offsets)
    return d_send, None, None, None


_xla_ragged.defvjp(_xla_ragged_fwd, _xla_ragged_bwd)


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


@dataclasses.dataclass(frozen=True)
class DispatchContext:
    """Static facts a strategy needs while tracing.

    axis_name: the expert mesh axis (None when there is one rank).
    num_ranks: P, ranks along axis_name.
    transport: "lax" (XLA collectives), "custom_call" (moe_jax's own: the
      in-process all-to-all on CPU, NCCL on XLA's communicator on GPU) or
      "nvlink" (count-aware peer-to-peer kernels, the GPUs of one host in
      one or several processes; strategies "ragged" and "cap_and_spill")
      or "fast" (the ragged strategy's rows along the FAST schedule of the
      traffic matrix on `fast_topology`; moe_jax.fast.transport).
    kernel_impl: "custom_call" or "reference" for pack / combine.
    platform: "cpu" or "gpu" (the platform the program is compiled for).
    mesh_devices: the mesh's devices in mesh order (needed by "nvlink").
    dispatch_fp8: "nvlink" only: dispatch e4m3 rows with per-128 scales,
      dequantized to the tokens' dtype before the expert function.
    data_axes: further manual mesh axes the tokens are split over (data
      parallelism); each combination of their indices is an independent
      group of `num_ranks` ranks along axis_name. Strategies never cross
      them; only the `*_tokens` reductions do.
    data_ranks: product of the data_axes' sizes (1 without them).
    fast_topology: "fast" only: the moe_jax.fast.Topology of one group's
      num_ranks ranks (servers x GPUs per server).

    On CPU every collective a strategy issues goes through this context,
    which chains them by data dependencies into one program order. XLA:CPU runs independent operations concurrently on a
    small thread pool; without a single order, blocking collectives issued in
    different orders on different devices could starve it and deadlock.
    """

    axis_name: str | None
    num_ranks: int
    transport: str = "lax"
    kernel_impl: str = "custom_call"
    platform: str = "cpu"
    mesh_devices: tuple | None = None
    dispatch_fp8: bool = False
    data_axes: tuple[str, ...] = ()
    data_ranks: int = 1
    fast_topology: object | None = None
    _chain: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    @property
    def _orders_collectives(self) -> bool:
        expert_parallel = self.axis_name is not None and self.num_ranks > 1
        return self.platform == "cpu" and (expert_parallel or self.data_ranks > 1)

    def start_chain(self) -> None:
        """Starts a new collective order (at the start of every traced call)."""
        self._chain.clear()

    def chain_state(self) -> list:
        return list(self._chain)

    def restore_chain(self, state: list) -> None:
        """Rewinds the chain (after tracing a lax.cond branch, whose values
        must not leak out)."""
        self._chain[:] = state

    def chain_after(self, tree):
        """Returns `tree` made to depend on the last collective, and makes it
        the new end of the chain (use it for values leaving lax.cond)."""
        if not self._orders_collectives:
            return tree
        if self._chain:
            tree = depend_on(tree, self._chain[-1])
        leaves = jax.tree.leaves(tree)
        if leaves:
            self._chain[:] = [opaque_zero(leaves[0])]
        return tree

    def _collective(self, fn, *args):
        if not self._orders_collectives:
            return fn(*args)
        out = fn(*self.chain_after(args))
        leaves = jax.tree.leaves(out)
        if leaves:  # the results stay untouched (a psum stays replicated)
            self._chain[:] = [opaque_zero(leaves[0])]
        return out

    def all_to_all(self, x: jax.Array) -> jax.Array:
        """[P, C, ...] blocks: result[src] = x@src[rank]. Identity for one rank."""
        if self.axis_name is None or self.num_ranks == 1:
            return x
        return self._collective(self._all_to_all, x)

    def _all_to_all(self, x: jax.Array) -> jax.Array:
        if self.transport == "custom_call":
            if self.platform != "cpu":
                return custom_calls.nccl_all_to_all(x, axis_name=self.axis_name)[0]
            return custom_calls.all_to_all(x, axis_name=self.axis_name)
        return jax.lax.all_to_all(x, self.axis_name, 0, 0, tiled=False)

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
            return xla_ragged_all_to_all(send, send_offsets, send_sizes, recv_offsets,
                                         recv_rows, self.axis_name)
        impl = "reference" if self.kernel_impl == "reference" and self.transport != \
            "custom_call" else "custom_call"
        return self._collective(
            lambda *a: custom_calls.ragged_all_to_all(*a, recv_rows=recv_rows,
                                                      axis_name=self.axis_name, impl=impl),
            send, send_offsets, send_sizes, recv_offsets)

    def grouped_all_to_all(self, send, send_sizes, recv_sizes, recv_rows):
        """Ragged all-to-all of contiguous groups: rows for each destination
        one after the other from row 0 of `send`, in rank order
        (`send_sizes` [P] int32), land on each receiver one source after the
        other from row 0 (`recv_sizes` [P] int32, this rank's own).

        Returns (recv [recv_rows, ...], recv_sizes [P]); rows past the total
        are zero. Transport "fast" moves them along the FAST schedule
        (moe_jax.fast.transport), every other one through ragged_all_to_all
        with offsets the exclusive sums of the sizes. Differentiable.
        """
        if self.transport != "fast" or self.axis_name is None or self.num_ranks == 1:
            return self.ragged_all_to_all(send, _exclusive_cumsum(send_sizes), send_sizes,
                                          _exclusive_cumsum(recv_sizes), recv_rows)
        return self._collective(
            lambda s, c: fast_transport.fast_all_to_all(
                s, c, axis_name=self.axis_name, topology=self.fast_topology,
                out_rows=recv_rows, platform=self.platform),
            send, send_sizes)

    def all_gather(self, x: jax.Array) -> jax.Array:
        """[P, ...]: every rank's x, stacked by rank ([1, ...] for one rank).

        Built as a psum of x placed in this rank's row, so the result is
        typed replicated over the axis (as it is) and usable as a predicate.
        """
        if self.axis_name is None:
            return x[None]
        placed = jnp.zeros((self.num_ranks,) + x.shape, x.dtype).at[self.rank()].set(x)
        return self.psum(placed)

    def rank(self) -> jax.Array:
        """This rank's index along the expert axis (int32 scalar)."""
        if self.axis_name is None:
            return jnp.zeros((), jnp.int32)
        return jax.lax.axis_index(self.axis_name).astype(jnp.int32)

    def psum(self, x):
        if self.axis_name is None:
            return x
        return self._collective(lambda v: jax.lax.psum(v, self.axis_name), x)

    def pmax(self, x):
        if self.axis_name is None:
            return x
        return self._collective(lambda v: jax.lax.pmax(v, self.axis_name), x)

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Every axis the tokens are split over: data_axes, then axis_name."""
        return self.data_axes + ((self.axis_name,) if self.axis_name is not None else ())

    def psum_tokens(self, x):
        """Sum over every rank holding tokens (all groups), replicated."""
        return self._reduce(jax.lax.psum, self.token_axes, x)

    def pmax_tokens(self, x):
        """Max over every rank holding tokens (all groups), replicated."""
        return self._reduce(jax.lax.pmax, self.token_axes, x)

    def _reduce(self, op, axes: tuple[str, ...], x):
        if not axes:
            return x
        def reduce(tree):
            # Typed varying over every axis first: a reduction over several
            # axes takes no input that varies over only some of them.
            tree = jax.tree.map(lambda a: manual_axes.as_varying(a, frozenset(axes)), tree)
            return op(tree, axes)
        return self._collective(reduce, x)

    def pack(self, *args, **kwargs):
        return custom_calls.pack(*args, impl=self.kernel_impl, platform=self.platform, **kwargs)

    def combine(self, *args, **kwargs):
        return custom_calls.combine(*args, impl=self.kernel_impl, platform=self.platform,
                                    **kwargs)

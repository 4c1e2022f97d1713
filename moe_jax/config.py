"""Configuration of an MoE layer, validated when it is built."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal, get_args

import jax.numpy as jnp
import numpy as np

Strategy = Literal["dense", "max_counts", "cap_and_spill", "ragged"]
Transport = Literal["auto", "lax", "custom_call", "nvlink", "fast"]
Matmul = Literal["auto", "cutlass", "row_invariant", "xla"]
KernelImpl = Literal["custom_call", "reference"]
RouterKind = Literal["softmax", "sigmoid_grouped"]

STRATEGIES = get_args(Strategy)
TRANSPORTS = get_args(Transport)
KERNEL_IMPLS = get_args(KernelImpl)
ROUTERS = get_args(RouterKind)
MATMULS = get_args(Matmul)


def _require(cond: bool, argument: str, message: str) -> None:
    if not cond:
        raise ValueError(f"MoEConfig.{argument}: {message}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Everything that fixes the shapes and the algorithm of one MoE layer.

    Attributes:
      hidden_size: model width H.
      ffn_size: width F of each SwiGLU expert.
      num_experts: total experts E; with expert parallelism over P ranks each
        rank holds E // P of them (E must divide by P).
      top_k: experts per token (1 <= top_k <= num_experts).
      strategy: how tokens reach their experts; every strategy is exact.
        "dense" (no expert parallelism, the reference), "max_counts"
        (per-peer buffers padded to the true worst case), "cap_and_spill"
        (pass 1 at `capacity`, pass 2 at `spill_capacity`, an exact fallback
        beyond both), "ragged" (only the real rows move).
      capacity: C, rows per (source, destination) pair in pass 1
        (cap_and_spill only; choose it with `moe_jax.calibrate`).
      spill_capacity: S, rows per pair in pass 2 (cap_and_spill only).
      transport: how buffers cross ranks: "lax" (`lax.all_to_all`, or
        `lax.ragged_all_to_all` for the ragged strategy on GPU),
        "custom_call" (moe_jax's own all-to-all custom call: in-process on
        CPU, where it also serves the ragged strategy, XLA:CPU having no
        ragged all-to-all; NCCL on GPU, where the ragged strategy rejects
        it), "nvlink" (count-aware peer-to-peer kernels that move only the
        real rows; the GPUs of one host, in one process or one per GPU
        under jax.distributed; strategies ragged and cap_and_spill; a
        warning is logged when the GPUs are peers over PCIe only) or
        "fast" (strategy ragged: the rows move along the FAST schedule of
        each call's traffic matrix on the two-tier `fast_topology`; see
        moe_jax.fast.transport) or "auto" (chosen from the devices'
        topology when the layer is traced, see moe_jax.topology, never
        "fast"; `moe_jax.resolve_transport` says what it picks and why,
        and the layer logs it). On GPUs the rare
        exact fallback of cap_and_spill runs `lax.all_to_all` whatever the
        transport (docs/design/cap_and_spill_fallback.md).
      fast_topology: with transport "fast": servers x GPUs per server of
        one expert-parallel group, as "NxM" (N * M must equal the expert
        axis' size; rank r is GPU r % M of server r // M). None: detected
        from `nvidia-smi topo -m` on GPUs (NVLink islands are servers), one
        server of P on CPU.
      dispatch_fp8: with transport "nvlink", send tokens as e4m3 with one
        float32 scale per 128 elements (about half the bytes of bf16; see
        moe_jax.nvlink) and dequantize them to bf16 for the experts; the
        combine stays bf16. Needs dtype bfloat16 and hidden_size % 512 == 0.
      kernel_impl: "custom_call" runs pack/combine as XLA FFI custom calls,
        "reference" runs their pure-JAX references instead.
      expert_axis: name of the mesh axis experts are sharded over.
      data_axes: further mesh axes the tokens are split over (data
        parallelism: e.g. ("data",) on a ("data", "ep") mesh). Each
        combination of their indices is an independent expert-parallel
        group along expert_axis with a full copy of the experts (expert
        weights are replicated over data_axes); tokens never cross them.
        The layer's losses and DispatchStats cover all groups. A string
        stands for a one-axis tuple.
      router: "softmax" (Mixtral top-k softmax) or "sigmoid_grouped"
        (DeepSeek-V3 sigmoid scores with group-limited selection).
      num_groups / topk_groups: expert groups and groups kept per token for
        the "sigmoid_grouped" router.
      routed_scaling: factor on the combine weights of the sigmoid router.
      load_balance_coef / router_z_coef: weights of the auxiliary losses.
      dtype: dtype of activations and expert matmul inputs.
      param_dtype: dtype of the parameters. Parameters wider than `dtype`
        (the float32 default with bfloat16 activations) are cast to
        `dtype` inside every call: each expert weight is read in float32
        and written once more in bfloat16 per call. For inference, keep
        the weights in `dtype` (param_dtype=jnp.bfloat16).
      matmul: how the experts (and, with "row_invariant", the router)
        multiply; see moe_jax.ops.grouped_matmul. "auto" (default): the
        CUTLASS grouped GEMM on Hopper GPUs for bfloat16/float16 (fused
        SwiGLU epilogue, row-invariant; where it would have fewer tiles
        than the GPU has SMs and the rows are few, e.g. 1-8 experts per
        rank at decode, one batched dense cuBLAS matmul instead, not
        row-invariant), XLA's `lax.ragged_dot` elsewhere.
        "cutlass": the CUTLASS kernels, or an error where they cannot run.
        "row_invariant": every row's bits depend only on that row and its
        expert's weights on every platform (the CUTLASS kernels where they
        apply, else `moe_jax.row_invariant`'s custom call; the router too),
        so every strategy, EP size and batch gives bitwise the same layer
        output; and the same gradients: the experts' weight gradients are
        float32 partials per (expert, source rank) added in rank order
        (moe_jax.ordered_grads; P times the local experts' weight-gradient
        memory in the backward), "dense" over a mesh adds its ranks'
        partials in the same order, and the layer is kept out of its
        neighbours' XLA fusions, so on a given mesh a model trains bit for
        bit alike on every strategy (docs/training.md; with data_axes the
        groups' sums are XLA's all-reduce); dtype bfloat16 or float32. "xla": `lax.ragged_dot` (on GPU
        a dense matmul over every expert, and the bits of a row can change
        with the number of rows in the call).
    """

    hidden_size: int
    ffn_size: int
    num_experts: int
    top_k: int = 2
    strategy: str = "cap_and_spill"
    capacity: int | None = None
    spill_capacity: int | None = None
    transport: str = "lax"
    kernel_impl: str = "custom_call"
    expert_axis: str = "ep"
    data_axes: tuple[str, ...] = ()
    router: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    load_balance_coef: float = 1e-2
    router_z_coef: float = 1e-3
    dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.float32
    dispatch_fp8: bool = False
    matmul: str = "auto"
    fast_topology: str | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "ffn_size", "num_experts", "top_k"):
            value = getattr(self, name)
            _require(isinstance(value, (int, np.integer)) and value >= 1, name,
                     f"must be a positive integer, got {value!r}")
        _require(self.top_k <= self.num_experts, "top_k",
                 f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        _require(self.strategy in STRATEGIES, "strategy",
                 f"must be one of {STRATEGIES}, got {self.strategy!r}")
        _require(self.transport in TRANSPORTS, "transport",
                 f"must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.transport == "fast":
            _require(self.strategy in ("ragged", "dense"), "strategy",
                     "transport 'fast' moves the ragged strategy's rows (only real rows, "
                     f"buffers sized for the worst case): use 'ragged', got {self.strategy!r}")
        if self.fast_topology is not None:
            _require(self.transport == "fast", "fast_topology",
                     f"is only used by transport 'fast', got transport={self.transport!r}")
            _require(isinstance(self.fast_topology, str)
                     and re.fullmatch(r"\s*[1-9]\d*\s*[xX]\s*[1-9]\d*\s*", self.fast_topology),
                     "fast_topology", "must look like '2x4' (servers x GPUs per server), "
                     f"got {self.fast_topology!r}")
        if self.dispatch_fp8:
            _require(self.transport == "nvlink" and jnp.dtype(self.dtype) == jnp.bfloat16
                     and self.hidden_size % 512 == 0, "dispatch_fp8",
                     "needs transport='nvlink', dtype bfloat16 and hidden_size a multiple of "
                     f"512, got transport={self.transport!r}, dtype={jnp.dtype(self.dtype)}, "
                     f"hidden_size={self.hidden_size}")
        _require(self.kernel_impl in KERNEL_IMPLS, "kernel_impl",
                 f"must be one of {KERNEL_IMPLS}, got {self.kernel_impl!r}")
        _require(self.router in ROUTERS, "router",
                 f"must be one of {ROUTERS}, got {self.router!r}")
        if self.strategy == "cap_and_spill":
            _require(self.capacity is not None, "capacity",
                     "cap_and_spill needs a capacity C (see moe_jax.calibrate)")
            _require(self.spill_capacity is not None, "spill_capacity",
                     "cap_and_spill needs a spill_capacity S (see moe_jax.calibrate)")
        if self.capacity is not None:
            _require(isinstance(self.capacity, (int, np.integer)) and self.capacity >= 1,
                     "capacity", f"must be an integer >= 1, got {self.capacity!r}")
        if self.spill_capacity is not None:
            _require(isinstance(self.spill_capacity, (int, np.integer))
                     and self.spill_capacity >= 0,
                     "spill_capacity", f"must be an integer >= 0, got {self.spill_capacity!r}")
        _require(isinstance(self.expert_axis, str) and self.expert_axis != "", "expert_axis",
                 "must be a mesh axis name")
        data_axes = self.data_axes
        if isinstance(data_axes, str):
            data_axes = (data_axes,)
        _require(isinstance(data_axes, (tuple, list))
                 and all(isinstance(a, str) and a for a in data_axes),
                 "data_axes", f"must be a tuple of mesh axis names, got {self.data_axes!r}")
        data_axes = tuple(data_axes)
        _require(len(set(data_axes)) == len(data_axes) and self.expert_axis not in data_axes,
                 "data_axes", f"must name distinct axes other than expert_axis="
                 f"{self.expert_axis!r}, got {data_axes}")
        object.__setattr__(self, "data_axes", data_axes)
        if self.router == "sigmoid_grouped":
            _require(self.num_groups >= 1 and self.num_experts % self.num_groups == 0,
                     "num_groups", f"must divide num_experts={self.num_experts}, "
                     f"got {self.num_groups}")
            _require(1 <= self.topk_groups <= self.num_groups, "topk_groups",
                     f"must be in [1, num_groups={self.num_groups}], got {self.topk_groups}")
            per_group = self.num_experts // self.num_groups
            _require(self.top_k <= self.topk_groups * per_group, "top_k",
                     f"top_k={self.top_k} exceeds the {self.topk_groups * per_group} experts "
                     "in the selected groups")
        for name in ("load_balance_coef", "router_z_coef"):
            _require(getattr(self, name) >= 0, name, "must be >= 0")
        _require(self.matmul in MATMULS, "matmul",
                 f"must be one of {MATMULS}, got {self.matmul!r}")
        if self.matmul == "row_invariant":
            _require(jnp.dtype(self.dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)),
                     "matmul", "'row_invariant' needs dtype bfloat16 or float32, got "
                     f"{jnp.dtype(self.dtype)}")
        for name in ("dtype", "param_dtype"):
            dt = jnp.dtype(getattr(self, name))
            _require(dt in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                            jnp.dtype(jnp.float16)),
                     name, f"must be float32, bfloat16 or float16, got {dt}")

    def experts_per_rank(self, num_ranks: int) -> int:
        """Experts each of `num_ranks` ranks holds; raises if E % P != 0."""
        if num_ranks < 1 or self.num_experts % num_ranks != 0:
            raise ValueError(
                f"MoEConfig.num_experts: {self.num_experts} experts cannot be split "
                f"evenly over {num_ranks} ranks of mesh axis {self.expert_axis!r}")
        return self.num_experts // num_ranks

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

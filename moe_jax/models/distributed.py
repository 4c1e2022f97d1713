"""Starting a process of a multi-process run (``jax.distributed``).

One process per GPU, or per group of CPU devices: every process runs the
same program on one global mesh over all processes' devices (see
:mod:`moe_jax.models.sharding` for placing inputs on it).

    initialize("10.0.0.1:12345", num_processes=4, process_id=i,
               local_device_ids=[i])            # GPU i of a 4-GPU host
    initialize("127.0.0.1:12345", num_processes=2, process_id=i)  # CPU

On CPU the processes' collectives go through gloo
(``jax_cpu_collectives_implementation``); the CPU devices per process come
from ``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set before
Python starts. moe_jax's CPU all-to-all custom call cannot cross processes
(:func:`moe_jax.models.generate.check_multiprocess`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

__all__ = ["initialize", "is_main_process"]


def initialize(coordinator: str, num_processes: int, process_id: int,
               local_device_ids: Sequence[int] | None = None) -> None:
    """Joins a run of `num_processes` processes coordinated at `coordinator`.

    Call it before anything touches a JAX backend (``jax.devices()``,
    creating arrays). Args: coordinator "host:port" (process 0 listens
    there); process_id in [0, num_processes); local_device_ids: the GPUs of
    this process (default: every visible one).
    """
    if not isinstance(coordinator, str) or ":" not in coordinator:
        raise ValueError(f"coordinator: must be 'host:port', got {coordinator!r}")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes: must be an integer >= 1, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id: must lie in [0, {num_processes}), got {process_id!r}")
    # Only the CPU backend reads it; it must be set before that backend starts.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id,
                               local_device_ids=None if local_device_ids is None
                               else list(local_device_ids))


def is_main_process() -> bool:
    """True in process 0 (the one that prints and writes files)."""
    return jax.process_index() == 0

"""The device mesh a MoE layer runs on: expert parallelism, optionally
inside data-parallel groups."""

from __future__ import annotations

import jax


def expert_mesh(ep: int, data_parallel: int = 1, devices=None) -> jax.sharding.Mesh:
    """A ("ep",) mesh of `ep` devices or, with data_parallel > 1, a
    ("data", "ep") mesh of data_parallel x ep devices (the layout of
    `MoEConfig(data_axes=("data",))`); Auto axis types.

    devices: the devices to use, in order (default jax.devices()); the first
    data_parallel * ep are taken.
    """
    devices = list(jax.devices() if devices is None else devices)
    if ep < 1 or data_parallel < 1 or data_parallel * ep > len(devices):
        raise ValueError(f"expert_mesh: ep={ep} x data_parallel={data_parallel} needs "
                         f"{max(ep, 1) * max(data_parallel, 1)} devices, got {len(devices)}")
    if data_parallel > 1:
        shape, names = (data_parallel, ep), ("data", "ep")
    else:
        shape, names = (ep,), ("ep",)
    return jax.make_mesh(shape, names, devices=devices[:data_parallel * ep],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(shape))

"""How the GPUs of an expert group are linked, and the transport that follows.

`peer_link(devices)` asks the driver (NVML, through ctypes; no build-time
dependency) how every pair of the given GPUs is connected: "nvlink" when
every pair is an NVLink (or NVSwitch) peer, "pcie" when every pair can
reach the other's memory but some only over PCIe, "none" when some pair
cannot, "unknown" when the driver cannot say (no NVML, GPUs of another
process). PCIe peer links move an all-to-all ~20x slower than NVLink (an
"NV#" against "NODE"/"SYS" in `nvidia-smi topo -m`), so the transport
choice below depends on it.

`fast_topology(spec, mesh, axis)` is the servers x GPUs layout transport
"fast" schedules over (given, or detected from `nvidia-smi topo -m`).

`choose_transport(strategy, platform, devices)` is what
`MoEConfig(transport="auto")` runs: the count-aware NVLink kernels where
every GPU of the group is an NVLink peer of every other in this process
(strategies ragged and cap_and_spill), else moe_jax's NCCL all-to-all
custom call for the padded strategies and `lax.ragged_all_to_all` for
ragged; on CPU the in-process custom call. It returns the transport and a
sentence saying why, which `moe_layer` logs once per compilation.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import NamedTuple, Sequence

import jax
import numpy as np

from moe_jax.fast.topology import Topology, detect_topology

logger = logging.getLogger("moe_jax")

_NVML_P2P_CAPS_INDEX_NVLINK = 2
_NVML_P2P_CAPS_INDEX_READ = 0
_NVML_P2P_STATUS_OK = 0


class TransportChoice(NamedTuple):
    transport: str
    reason: str


@functools.lru_cache(maxsize=1)
def _libraries():
    """(nvml, cuda driver) handles, or None where either cannot load."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0 or cuda.cuInit(0) != 0:
        return None
    return nvml, cuda


def _nvml_handle(libs, ordinal: int):
    nvml, cuda = libs
    device = ctypes.c_int()
    bus_id = ctypes.create_string_buffer(32)
    if cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0 or \
            cuda.cuDeviceGetPCIBusId(bus_id, len(bus_id), device) != 0:
        return None
    handle = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus_id, ctypes.byref(handle)) != 0:
        return None
    return handle


def _p2p(libs, a, b, index: int) -> bool | None:
    status = ctypes.c_int()
    if libs[0].nvmlDeviceGetP2PStatus(a, b, index, ctypes.byref(status)) != 0:
        return None
    return status.value == _NVML_P2P_STATUS_OK


@functools.lru_cache(maxsize=None)
def _link_of_ordinals(ordinals: tuple[int, ...]) -> str:
    """The link of a group of local CUDA ordinals; asked of NVML once per group
    (the layer asks at every trace)."""
    libs = _libraries()
    if libs is None:
        return "unknown"
    handles = [_nvml_handle(libs, o) for o in ordinals]
    if any(h is None for h in handles):
        return "unknown"
    link = "nvlink"
    for i, a in enumerate(handles):
        for b in handles[i + 1:]:
            nvlink = _p2p(libs, a, b, _NVML_P2P_CAPS_INDEX_NVLINK)
            if nvlink is None:
                return "unknown"
            if nvlink:
                continue
            readable = _p2p(libs, a, b, _NVML_P2P_CAPS_INDEX_READ)
            if readable is None:
                return "unknown"
            if not readable:
                return "none"
            link = "pcie"
    return link


def peer_link(devices: Sequence) -> str:
    """"nvlink" | "pcie" | "none" | "unknown" for a group of jax GPU devices
    (module doc). A single device is trivially "nvlink"; devices of
    another process make it "unknown"."""
    devices = list(devices)
    if len(devices) <= 1:
        return "nvlink"
    if any(d.platform != "gpu" for d in devices):
        return "unknown"
    try:
        import jax
        local = {d.id for d in jax.local_devices()}
    except Exception:  # noqa: BLE001 - detection must never break a trace
        return "unknown"
    if any(d.id not in local for d in devices):
        return "unknown"
    return _link_of_ordinals(tuple(int(d.local_hardware_id) for d in devices))


def choose_transport(strategy: str, platform: str, devices: Sequence,
                     link: str | None = None) -> TransportChoice:
    """The transport `transport="auto"` runs (module doc). `link` overrides
    the detected `peer_link(devices)`."""
    if platform == "cpu":
        if len({d.process_index for d in devices}) > 1:
            return TransportChoice("lax", "CPU devices of several processes: XLA's "
                                          "collectives (the custom call is in-process)")
        return TransportChoice("custom_call", "CPU devices: moe_jax's in-process all-to-all")
    if len(devices) <= 1 or strategy == "dense":
        return TransportChoice("lax", "one rank: nothing crosses ranks")
    link = peer_link(devices) if link is None else link
    if link == "nvlink" and strategy in ("ragged", "cap_and_spill"):
        return TransportChoice("nvlink", f"the {len(devices)} GPUs are NVLink peers: the "
                                         "count-aware NVLink kernels move only real rows")
    where = {"nvlink": "NVLink peers", "pcie": "peers over PCIe only",
             "none": "not all peers", "unknown": "of unknown topology"}[link]
    if strategy == "ragged":
        return TransportChoice("lax", f"the {len(devices)} GPUs are {where}: "
                                      "lax.ragged_all_to_all moves the real rows")
    return TransportChoice("custom_call", f"the {len(devices)} GPUs are {where}: moe_jax's "
                                          "NCCL all-to-all moves the padded buffers")


def fast_topology(spec: str | None, mesh, expert_axis: str):
    """The moe_jax.fast.Topology transport "fast" schedules over: that of
    one expert-parallel group (the ranks along `expert_axis`).

    `spec` ("NxM", MoEConfig.fast_topology) is taken as given and must have
    the axis' size in GPUs. None: on CPU one server of P devices; on GPUs
    read from `nvidia-smi topo -m` for the first group's GPUs (NVLink
    islands are servers; moe_jax.fast.topology), which must be GPUs of this
    process (otherwise give it); logged (a warning where detection gave no
    usable grouping). Raises ValueError naming the argument.
    """
    axis = list(mesh.axis_names).index(expert_axis)
    group = np.moveaxis(np.asarray(mesh.devices), axis, 0).reshape(mesh.shape[expert_axis], -1)
    devices = list(group[:, 0])
    num_ranks = len(devices)
    platform = devices[0].platform
    if platform == "cpu" and len({d.process_index for d in mesh.devices.flat}) > 1:
        raise ValueError("MoEConfig.transport: 'fast' runs on CPU through the in-process "
                         "all-to-all custom call, which cannot cross processes")
    if spec is not None:
        topology = Topology.parse(spec)
        if topology.num_gpus != num_ranks:
            raise ValueError(f"MoEConfig.fast_topology: {spec!r} has {topology.num_gpus} "
                             f"GPUs but mesh axis {expert_axis!r} has {num_ranks} ranks")
        return topology
    if platform == "cpu":
        return Topology(1, num_ranks, "default", "CPU devices")
    try:
        local = {d.id for d in jax.local_devices(backend=platform)}
    except RuntimeError:  # no such backend in this process
        local = set()
    if any(d.id not in local for d in devices):
        raise ValueError("MoEConfig.fast_topology: cannot be detected for GPUs of other "
                         "processes; give it as 'NxM' (servers x GPUs per server)")
    topology = detect_topology(num_ranks,
                               gpu_indices=[int(d.local_hardware_id) for d in devices])
    if topology.source == "default":
        logger.warning("moe_jax: transport='fast' schedules over one server of %d GPUs: %s "
                       "(give MoEConfig.fast_topology)", num_ranks, topology.detail)
    else:
        logger.info("moe_jax: transport='fast' schedules over %s GPUs (%s)", topology,
                    topology.source)
    return topology

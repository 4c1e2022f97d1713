"""FAST all-to-all(v) scheduling (Lei et al., NSDI '26) and its execution.

Host side (NumPy / C++, no JAX):
``reference``: pure-Python scheduler, SpreadOut, bounds, delivery check.
``cpp``: the same scheduler, execution planner and a CPU simulation of the
GPU's NCCL sequence in C++ (``moe_jax._fast``, optional).
``plan``: which buffer rows every scheduled transfer moves, by phase.
``phases``: one rank's plan as index arrays for ragged all-to-alls.
``topology``: servers x GPUs, given or from ``nvidia-smi topo -m``.
``simulator``: analytical two-tier alpha-beta completion-time model.
``workloads``: uniform and Zipf traffic matrices.

From jit (``staged``): ``staged_all_to_all`` (CUDA custom call or
pure_callback + ragged all-to-alls) and ``reference_all_to_all``.
"""

from moe_jax.fast import (cpp, phases, plan, reference, simulator, staged,
                          topology, workloads)
from moe_jax.fast.reference import (Schedule, Stage, Transfer,
                                    delivered_exactly, fast_schedule,
                                    lower_bounds, spreadout_schedule,
                                    spreadout_time)
from moe_jax.fast.staged import (effective_traffic, reference_all_to_all,
                                 staged_all_to_all)
from moe_jax.fast.topology import Topology, detect_topology

__all__ = ["cpp", "phases", "plan", "reference", "simulator", "staged",
           "topology", "workloads", "Schedule", "Stage", "Transfer",
           "Topology", "delivered_exactly", "detect_topology",
           "effective_traffic", "fast_schedule", "lower_bounds",
           "reference_all_to_all", "spreadout_schedule", "spreadout_time",
           "staged_all_to_all"]

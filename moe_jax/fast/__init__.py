"""FAST all-to-all(v) scheduling (Lei et al., NSDI '26): CPU side.

``reference``: pure-Python scheduler, SpreadOut, bounds, delivery check.
``cpp``: the same scheduler in C++ (``moe_jax._fast``, optional).
``simulator``: analytical two-tier alpha-beta completion-time model.
``workloads``: uniform and Zipf traffic matrices.
"""

from moe_jax.fast import cpp, reference, simulator, workloads
from moe_jax.fast.reference import (Schedule, Stage, Transfer,
                                    delivered_exactly, fast_schedule,
                                    lower_bounds, spreadout_schedule,
                                    spreadout_time)

__all__ = ["cpp", "reference", "simulator", "workloads", "Schedule", "Stage",
           "Transfer", "delivered_exactly", "fast_schedule", "lower_bounds",
           "spreadout_schedule", "spreadout_time"]

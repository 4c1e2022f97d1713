"""FAST all-to-all(v) scheduling (Lei et al., NSDI '26): CPU side.

``reference``: pure-Python scheduler, SpreadOut, bounds, delivery check.
``simulator``: analytical two-tier alpha-beta completion-time model.
``moe_jax._fast`` (C++, optional): the same scheduler, fast.
"""

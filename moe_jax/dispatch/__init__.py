"""Dispatch strategies behind one interface; see `dispatch_combine`."""

from moe_jax.dispatch.api import DispatchResult, dispatch_combine
from moe_jax.dispatch.context import DispatchContext
from moe_jax.dispatch.passes import Delivered, ExpertFn
from moe_jax.dispatch.stats import DispatchStats

__all__ = ["DispatchContext", "DispatchResult", "DispatchStats", "Delivered", "ExpertFn",
           "dispatch_combine"]

"""Asynchronous expert parallelism (AMoE-style) simulated on JAX devices (CPU or GPU).

Devices do not meet at an all-to-all barrier: every device keeps one FIFO
queue per layer it hosts (attention of a block on an attention rank, or one
(block, expert) FFN), a scheduler picks which queue to drain, and outputs are
forwarded to the device of the next layer. The top-k copies of a token meet
again in a pool that merges them exactly as a synchronous combine would.
"""

from moe_jax.async_ep.tokens import LayerId, Token, attention_layer, expert_layer, sampler_layer
from moe_jax.async_ep.queues import LayerQueues
from moe_jax.async_ep.pool import TokenPool, Receptor, combine_topk
from moe_jax.async_ep.schedulers import (DefragScheduler, FirstLayerFirst, MostTokensFirst,
                                         Scheduler, SchedulerState, make_scheduler)
from moe_jax.async_ep.requests import Coordinator, Request
from moe_jax.async_ep.dispatcher import Dispatcher, Placement
from moe_jax.async_ep.model import LayerKernels, TinyMoEConfig, init_params
from moe_jax.async_ep.costs import CostTable
from moe_jax.async_ep.executor import AsyncEngine, Delivery, DeviceExecutor, RunResult, TimedAsyncEngine
from moe_jax.async_ep.baseline import SyncEngine

__all__ = [
    "AsyncEngine", "Coordinator", "CostTable", "DefragScheduler", "Delivery", "DeviceExecutor", "Dispatcher",
    "FirstLayerFirst", "LayerId", "LayerKernels", "LayerQueues", "MostTokensFirst", "Placement",
    "Receptor", "Request", "RunResult", "Scheduler", "SchedulerState", "SyncEngine",
    "TimedAsyncEngine", "TinyMoEConfig", "Token", "TokenPool", "attention_layer", "combine_topk",
    "expert_layer", "init_params", "make_scheduler", "sampler_layer",
]

"""Asynchronous expert parallelism (AMoE-style) simulated on CPU devices.

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

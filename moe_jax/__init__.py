"""moe_jax: exact, fixed-shape Mixture-of-Experts dispatch for JAX."""

from moe_jax import custom_calls
from moe_jax.calibration import Calibration, calibrate
from moe_jax.config import MoEConfig
from moe_jax.dispatch import (Delivered, DispatchContext, DispatchResult, DispatchStats,
                              dispatch_combine)
from moe_jax.experts import ExpertWeights, init_expert_weights, swiglu_grouped
from moe_jax.layer import MoEAux, MoEParams, init_moe_params, moe_layer, resolve_transport
from moe_jax.mesh import expert_mesh
from moe_jax.plan import DispatchPlan, make_plan
from moe_jax.rebalance import Rebalancer, move_slots
from moe_jax.replicated import logical_weights, slot_weights
from moe_jax.replication import LoadTracker, Placement, PlacementArrays, propose
from moe_jax.routing import Routing, route
from moe_jax.traces import (RoutingTrace, generate_traces, load_jsonl, mixtral_8x7b_ep8,
                            per_peer_counts, save_jsonl)

__version__ = "0.1.0"

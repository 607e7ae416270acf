"""hpmoe: expert-parallel MoE layers compiled to statically scheduled tile tasks.

Pipeline: ``MoESpec`` → ``route`` → ``plan_routing`` → ``lower_forward`` (TaskGraph)
→ schedule → simulate | run.  ``moe_forward`` runs the whole forward region exactly,
with every EP rank virtual in one process.
"""

from .engine import moe_forward
from .exec.exact import execute_forward
from .exec.exact_backward import execute_backward, moe_forward_backward
from .ir.analysis import GraphError
from .ir.graph import TaskGraph, TaskKind, Unit
from .ir.verify import verify_graph
from .nn.checkpoint import TrainState, logical_optimizer
from .nn.hf import weights_from_hf
from .nn.layer import MoE
from .nn.replace import replace_moe_blocks
from .regions.backward import lower_backward
from .regions.forward import lower_forward
from .routing import Routing, RoutingKind, RoutingPlan, plan_routing, route, synthetic_routing
from .spec import GateKind, MoESpec, ParallelSpec, Recompute, TileSpec, preset
from .weights import ExpertWeights

__all__ = [
    "MoE", "execute_backward", "lower_backward", "moe_forward_backward", "replace_moe_blocks",
    "ExpertWeights", "GateKind", "GraphError", "MoESpec", "ParallelSpec", "Routing", "RoutingKind",
    "RoutingPlan", "TaskGraph", "TaskKind", "TileSpec", "Unit", "execute_forward", "lower_forward",
    "moe_forward", "plan_routing", "preset", "route", "synthetic_routing", "verify_graph", "weights_from_hf",
    "Recompute", "TrainState", "logical_optimizer",
]

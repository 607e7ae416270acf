"""The core objects the GPU backend reads, imported in one place.

The backend consumes the compiler's output (task graphs, schedules, plans) and the
runtime's report types; when a core module moves or renames a type, only this file
changes."""

from __future__ import annotations

from ..deprecation import deprecated
from ..exec.exact import DEFAULT_TILES
from ..exec.exact_backward import Gradients
from ..ir.analysis import GraphError
from ..ir.graph import IS_PUT, TaskColumns, TaskGraph, TaskKind, Tile, Unit
from ..ir.schedule import Schedule, WorkerCounts
from ..machine import capturing
from ..regions.backward_kernels import BACKWARDS, ROW_TAIL, row_width
from ..regions.base import as_kept
from ..regions.kernels import FORWARD
from ..regions.slot_backward import plan_slot_backward
from ..regions.slot_routing import SlotRouting, live_rows, resolve_slots
from ..regions.slots import SlotPlan, SlotShape, plan_slots
from ..routing import Routing, RoutingPlan, check_input, plan_routing
from ..runtime.forensics import HangReport, RegionError, WorkerReport, WorkerStatus
from ..schedule import SchedulePolicy, schedule, verify_schedule
from ..sim.cost import gemm_dims, task_costs
from ..sim.hardware import HardwareModel, LinkEntry
from ..sim.presets import hardware_preset
from ..sim.simulate import Timeline
from ..spec import MoESpec, ParallelSpec, TileSpec
from ..weights import ExpertWeights, SlotGradients, slot_targets

__all__ = ["BACKWARDS", "DEFAULT_TILES", "ExpertWeights", "FORWARD", "Gradients", "GraphError",
           "HangReport", "HardwareModel", "IS_PUT", "LinkEntry", "MoESpec", "ParallelSpec", "ROW_TAIL",
           "RegionError", "Routing", "RoutingPlan", "Schedule", "SchedulePolicy", "SlotGradients",
           "SlotPlan", "SlotRouting", "SlotShape", "TaskColumns", "TaskGraph", "TaskKind", "Tile", "TileSpec",
           "Timeline", "Unit", "WorkerCounts", "WorkerReport", "WorkerStatus", "as_kept", "capturing",
           "check_input", "deprecated", "gemm_dims", "hardware_preset", "live_rows", "plan_routing",
           "plan_slot_backward", "plan_slots", "resolve_slots", "row_width", "schedule", "slot_targets",
           "task_costs", "verify_schedule"]

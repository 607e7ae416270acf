"""The front door of every region call.  ``select`` (``engine.selection``) turns the
caller's ``RegionOptions`` into one ``RegionPath`` (``engine.paths``: the exact
executors, the multi-rank runtime, the persistent Triton kernel, kernel by kernel) —
AUTO lives there and nowhere else — and ``paths.run`` runs it as one autograd node.
The layer, the drop-in, the compile path and ``moe_forward`` all come through here; the
executors do not import one another, this package imports them."""

from __future__ import annotations

import torch

from ..exec.backend import Backend, as_backend
from ..exec.exact import DEFAULT_TILES, Order
from ..ir.schedule import SchedulePolicy
from ..routing import Routing, check_input
from ..schedule.auto import DecisionCache
from ..sim.hardware import HardwareModel
from ..spec import TileSpec, require_per_expert
from ..weights import ExpertWeights
from .options import RegionOptions
from .paths import (
    ExactPath,
    KernelByKernelPath,
    RegionCall,
    RegionClock,
    RegionFunction,
    RegionPath,
    RegionState,
    RuntimePath,
    TritonPath,
    run,
)
from .selection import PROCESS_AUTO, Auto, decision, select, tune_key, tuned

__all__ = ["PROCESS_AUTO", "Auto", "ExactPath", "KernelByKernelPath", "RegionCall", "RegionClock",
           "RegionFunction", "RegionOptions", "RegionPath", "RegionState", "RuntimePath", "TritonPath",
           "decision", "moe_forward", "run", "select", "tune_key", "tuned"]

_TRITON = "the triton backend (no device operations for EXPAND, PARTIAL_REDUCE, PARTIAL_SUM)"


def moe_forward(x: torch.Tensor, weights: ExpertWeights, routing: Routing, ep: int = 1,
                tiles: TileSpec = DEFAULT_TILES, order: Order = None,
                backend: Backend | str = Backend.EXACT, policy: SchedulePolicy = SchedulePolicy.AUTO,
                hardware: HardwareModel | None = None, decisions: DecisionCache | None = None
                ) -> torch.Tensor:
    """Routed plus shared-expert output [N, H] of the MoE layer of ``ep`` expert-parallel
    ranks in one process.

    policy: AUTO (default, with ``order`` None) runs what ``schedule.auto`` forecasts
    faster for this routing shape on ``hardware`` (default: the saved cpu profile; none:
    the kernel-by-kernel path), decided once per routing shape and kept in ``decisions``
    (default: the process's); SERIAL (or any ``order``) runs the tile task graph in
    ``order`` (task ids, a seed of a random valid order, None: task-id order).
    ``backend="triton"``: one persistent Triton kernel on ``x.device`` (``hpmoe.gpu``);
    ``order`` is then not used and must be None."""
    backend = as_backend(backend)
    if backend is Backend.AUTO:
        raise ValueError("backend='auto' measures over a layer's calls: use hpmoe.MoE(..., backend='auto')")
    if backend is Backend.TRITON:
        if order is not None:
            raise ValueError(f"order={order!r}: the triton backend runs a schedule, not a task order")
        require_per_expert(tiles, _TRITON)
    if policy not in (SchedulePolicy.AUTO, SchedulePolicy.SERIAL):
        raise ValueError(f"policy={policy!r}: in one process, AUTO or SERIAL (the task graph)")
    auto = policy is SchedulePolicy.AUTO and order is None
    check_input(x, routing, weights.spec)  # the one check of the call: no path checks again
    options = RegionOptions(virtual_ep=ep, schedule=policy if auto else order, tiles=tiles,
                            hardware=hardware if auto else None, backend=backend)
    memory = PROCESS_AUTO if decisions is None else Auto(decisions)
    path, _ = select(options, weights.spec, x.shape[0], memory, device=x.device)
    return path.forward(x, routing, weights, False)[0]

"""The front door of a one-process region call: ``moe_forward`` chooses the path (the
exact taskflow executor, kernel by kernel under AUTO, or the persistent Triton kernel)
and calls it; ``one_process_decision`` is AUTO's choice in one process, which
``moe_forward``, the layer (``virtual_ep``) and the compile path all read.  The
executors do not import one another; this module imports them."""

from __future__ import annotations

import torch

from .exec.backend import Backend, as_backend
from .exec.exact import DEFAULT_TILES, Order, execute_forward
from .exec.kernel_by_kernel import kbk_forward
from .ir.schedule import SchedulePolicy
from .routing import Routing, check_hidden
from .schedule.auto import PROCESS_DECISIONS, AutoDecision, DecisionCache, Path, RoutingShape
from .sim.hardware import HardwareModel
from .spec import MoESpec, TileSpec, require_per_expert
from .weights import ExpertWeights

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
    (default: ``schedule.auto.PROCESS_DECISIONS``);
    SERIAL (or any ``order``) runs the tile task graph (see ``execute_forward``).
    ``backend="triton"``: one persistent Triton kernel on ``x.device`` (``hpmoe.gpu``);
    ``order`` is then not used and must be None."""
    if as_backend(backend) is Backend.TRITON:
        if order is not None:
            raise ValueError(f"order={order!r}: the triton backend runs a schedule, not a task order")
        require_per_expert(tiles, _TRITON)
        from .gpu.backend import triton_forward
        return triton_forward(x, weights, routing, ep, tiles).out
    if policy not in (SchedulePolicy.AUTO, SchedulePolicy.SERIAL):
        raise ValueError(f"policy={policy!r}: in one process, AUTO or SERIAL (the task graph)")
    if policy is SchedulePolicy.AUTO and order is None:
        check_hidden(x, weights.spec)
        decision = one_process_decision(weights.spec, ep, x.shape[0], tiles, hardware, decisions)
        if decision.chosen.path is not Path.TASKFLOW:
            return kbk_forward(x, routing, weights)[0]
    return execute_forward(x, weights, routing, ep, tiles, order).out


def one_process_decision(spec: MoESpec, ep: int, tokens: int, tiles: TileSpec,
                         hardware: HardwareModel | None = None, decisions: DecisionCache | None = None,
                         backward: bool = False) -> AutoDecision:
    """AUTO's choice for ``tokens`` tokens over ``ep`` virtual ranks in one process: what
    ``hardware`` (default: the saved cpu profile) forecasts faster, the kernel-by-kernel
    path without one; made once per shape and kept in ``decisions`` (default: the
    process's, ``schedule.auto.PROCESS_DECISIONS``)."""
    cache = decisions if decisions is not None else PROCESS_DECISIONS
    return cache.decide(RoutingShape.one_process(spec, ep, tokens, backward), tiles, hardware)

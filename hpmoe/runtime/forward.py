"""The forward Dispatch-to-Combine region on the runtime.

Per call, on every rank of the session's group (plan of ``ForwardRunner.__call__``):
  1. snapshot the counters (``Transport.begin``);
  2. all-gather token counts per (expert, token tile) — the only collective;
  3. rebuild the plan, lower every rank's graph and schedule it (the schedulers
     need all ranks; every rank computes the same schedule), keep this rank's part;
  4. size symmetric memory and post receives (``Transport.prepare``);
  5. run the rank's workers; the output rows are this rank's tokens.
Steps 2-5 are the Dispatch-to-Combine time.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..exec.program import PutSpec, RankProgram, Taskflow, compile_program, symmetric_fields
from ..ir.graph import IS_PUT, TaskGraph, TaskKind
from ..regions.forward import lower_forward
from ..regions.kernels import KERNELS, ForwardBuffers, RankContext
from ..routing import Routing, RoutingPlan, check_hidden, check_routing
from ..schedule import critical_path_schedule, hyperparallel_schedule, serial_schedule
from ..schedule.base import Schedule, SchedulePolicy, WorkerCounts
from ..sim.hardware import HardwareModel
from ..spec import ParallelSpec, TileSpec
from ..weights import ExpertWeights
from .faults import Fault
from .plan import exchange_tile_counts, plan_from_tile_counts
from .session import Session
from .timeline import RunTimeline
from .transport.base import Step

_CATEGORIES = ("ROWS", "H", "A", "Y", "OUT", "SH", "SA", "PERM")


def forward_symmetric_shapes(plan: RoutingPlan, rank: int) -> dict:
    """recv [R_rank, H] and comb [T*k, H] in the layer's dtype."""
    moe, t = plan.moe, plan.par.tokens_per_rank
    return {"recv": ((plan.recv_rows(rank), moe.hidden), moe.dtype),
            "comb": ((t * moe.top_k, moe.hidden), moe.dtype)}


def forward_event_name(graph: TaskGraph, rank: int, event: int) -> str:
    """e.g. ``event r1:7 (OUT 2)`` from the forward layout's event categories."""
    layout = graph.meta.get("layout")
    if layout is None or event >= layout.event_count(rank):
        return f"event r{rank}:{event} (schedule barrier)"
    starts = [int(layout.base(rank, c)) for c in _CATEGORIES]
    k = int(np.searchsorted(starts, event, side="right")) - 1  # last category starting <= event
    return f"event r{rank}:{event} ({_CATEGORIES[k]} {event - starts[k]})"


FORWARD = Taskflow(
    name="forward", kernels={k: fn for k, fn in KERNELS.items() if not IS_PUT[k]},
    puts={TaskKind.DISPATCH: PutSpec(src="send", dst="recv"),
          TaskKind.COMBINE: PutSpec(src="y", dst="comb")},
    symmetric=symmetric_fields(ForwardBuffers), lower=lower_forward,
    symmetric_shapes=forward_symmetric_shapes,
    describe_event=forward_event_name)


def make_schedule(graph: TaskGraph, policy: SchedulePolicy, workers: WorkerCounts,
                  hardware: HardwareModel | None = None) -> Schedule:
    """Schedule every rank of ``graph`` on ``workers``; CRITICAL_PATH costs tasks on
    ``hardware`` (its worker counts replaced by ``workers``)."""
    if policy is SchedulePolicy.SERIAL:
        return serial_schedule(graph, workers)
    if policy is SchedulePolicy.HYPERPARALLEL:
        return hyperparallel_schedule(graph, workers)
    if hardware is None:
        raise ValueError("schedule=critical-path needs a hardware model: run `hpmoe calibrate` "
                         "for the cpu profile")
    hw = dataclasses.replace(hardware, matrix_workers=workers.matrix, vector_workers=workers.vector)
    return critical_path_schedule(graph, hw)


@dataclass(frozen=True)
class ForwardOptions:
    """tiles: the tiling.  policy: the scheduler.  hardware: the cost model of
    CRITICAL_PATH.  cache_schedules: reuse the schedule when the exchanged token
    counts repeat (identical counts give an identical graph)."""

    tiles: TileSpec = TileSpec()
    policy: SchedulePolicy = SchedulePolicy.HYPERPARALLEL
    hardware: HardwareModel | None = None
    cache_schedules: bool = False


@dataclass(frozen=True)
class StepTimes:
    """Seconds of one call: count exchange; plan + lower + schedule + compile;
    memory and receives; the region's workers."""

    exchange_s: float
    schedule_s: float
    prepare_s: float
    region_s: float


@dataclass
class ForwardOutput:
    """out: [T, H] spec.dtype, this rank's tokens.  buffers: the rank's buffers
    (``recv``/``comb`` view symmetric memory: valid until the next call).
    schedule: every rank's schedule; program: this rank's part."""

    out: torch.Tensor
    buffers: ForwardBuffers
    schedule: Schedule
    program: RankProgram
    timeline: RunTimeline
    times: StepTimes


class ForwardRunner:
    """Runs the forward region of ``weights`` (the whole layer; this rank uses its
    experts) on ``session``'s rank, once per call."""

    def __init__(self, session: Session, weights: ExpertWeights, options: ForwardOptions | None = None):
        self.session, self.weights = session, weights
        self.options = options or ForwardOptions()
        self._cache: dict[bytes, Schedule] = {}

    def __call__(self, x: torch.Tensor, routing: Routing, fault: Fault | None = None) -> ForwardOutput:
        """x: [T, H] spec.dtype this rank's tokens; routing: their ids/weights [T, k]."""
        spec, s = self.weights.spec, self.session
        check_hidden(x, spec)
        check_routing(routing, spec, x.shape[0])
        par = ParallelSpec(ep=s.world, tokens_per_rank=x.shape[0])
        marks = [time.perf_counter()]
        s.transport.begin()
        counts = exchange_tile_counts(routing.ids, spec.experts, self.options.tiles.rows, s.group)
        marks.append(time.perf_counter())
        plan = plan_from_tile_counts(routing.ids, counts, spec, par, s.rank, self.options.tiles.rows)
        schedule = self._schedule(plan, counts)
        program = compile_program(schedule, FORWARD, s.rank)
        program, kernels = fault.apply(program, FORWARD.kernels) if fault else (program, FORWARD.kernels)
        marks.append(time.perf_counter())
        sym = s.transport.prepare(Step(FORWARD, plan, self.options.tiles, schedule, program))
        buffers = ForwardBuffers.allocate(x, plan, s.rank, recv=sym["recv"], comb=sym["comb"])
        ctx = rank_context(self.weights, plan, routing, s.rank)
        marks.append(time.perf_counter())
        result = s.executor.run(program, FORWARD, buffers, ctx, s.transport, kernels)
        marks.append(time.perf_counter())
        times = StepTimes(*np.diff(marks).tolist())
        return ForwardOutput(out=buffers.out, buffers=buffers, schedule=schedule, program=program,
                             timeline=result.timeline, times=times)

    def _schedule(self, plan: RoutingPlan, counts: torch.Tensor) -> Schedule:
        o = self.options
        key = counts.numpy().tobytes() + bytes(str(plan.par), "ascii")
        if o.cache_schedules and key in self._cache:
            return self._cache[key]
        graph = lower_forward(plan, o.tiles)
        schedule = make_schedule(graph, o.policy, self.session.config.workers, o.hardware)
        if o.cache_schedules:
            self._cache = {key: schedule}
        return schedule


def rank_context(weights: ExpertWeights, plan: RoutingPlan, routing: Routing, rank: int) -> RankContext:
    """``RankContext`` of ``rank`` from its own routing ([T, k]) only."""
    local, k = plan.local_experts, plan.moe.top_k
    experts = slice(rank * local, (rank + 1) * local)
    return RankContext(weights=weights, w13=weights.w13[experts], w2=weights.w2[experts],
                       token_of_row=plan.order[rank] // k, pos=plan.pos[rank],
                       topk_weights=routing.weights)



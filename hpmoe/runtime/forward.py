"""The forward Dispatch-to-Combine region on the runtime.

Per call, on every rank of the session's group (plan of ``ForwardRunner.__call__``):
  0. agree on the region's fingerprint and every rank's input (``Session.agree``);
  1. snapshot the counters (``Transport.begin``);
  2. all-gather token counts per (expert, token tile) (deduplicated dispatch: every
     rank's routing ids and weights, which a receiver needs to expand and weigh rows);
  3. rebuild the plan, lower every rank's graph and schedule it (the schedulers
     need all ranks; every rank computes the same schedule), keep this rank's part;
  4. size symmetric memory and post receives (``Transport.prepare``);
  5. run the rank's workers; the output rows are this rank's tokens.
Steps 2-5 are the Dispatch-to-Combine time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..exec.program import RankProgram, compile_program, compile_region
from ..ir.schedule import Schedule, SchedulePolicy
from ..regions.base import Region
from ..regions.dedup_kernels import DedupBuffers
from ..regions.family import region_family
from ..regions.kernels import ForwardBuffers
from ..routing import Routing, RoutingPlan, input_error, plan_routing
from ..sim.hardware import HardwareModel
from ..sim.presets import cpu_nominal
from ..spec import MoESpec, ParallelSpec, TileSpec
from ..weights import ExpertWeights
from .faults import Fault
from .plan import exchange_routing, exchange_tile_counts, plan_from_tile_counts
from .session import Session
from .timeline import RunTimeline
from .transport.base import Step


@dataclass(frozen=True)
class ForwardOptions:
    """tiles: the tiling.  policy: the scheduler.  hardware: the rank's model: its worker
    counts are the runtime's worker threads, its rates the cost model of CRITICAL_PATH
    (default: ``cpu_nominal()``, one matrix and one vector worker).  cache_schedules:
    reuse the schedule when the exchanged token counts repeat (identical counts give an
    identical graph).  nodes: nodes the EP group spans (``TileSpec(dispatch=PER_NODE)``
    relays between them)."""

    tiles: TileSpec = TileSpec()
    policy: SchedulePolicy = SchedulePolicy.HYPERPARALLEL
    hardware: HardwareModel = field(default_factory=cpu_nominal)
    cache_schedules: bool = False
    nodes: int = 1


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
    plan: the routing plan the region ran; schedule: every rank's schedule;
    program: this rank's part.  routing: what the rank's context was built from, this
    rank's routing [T, k] or, deduplicated, every rank's [ep*T, k] (the backward's input)."""

    out: torch.Tensor
    buffers: ForwardBuffers | DedupBuffers
    plan: RoutingPlan
    schedule: Schedule
    program: RankProgram
    timeline: RunTimeline
    times: StepTimes
    routing: Routing


class ForwardRunner:
    """Runs the forward region of ``weights`` (the whole layer; this rank uses its
    experts) on ``session``'s rank, once per call."""

    def __init__(self, session: Session, weights: ExpertWeights, options: ForwardOptions | None = None):
        self.session, self.weights = session, weights
        self.options = options or ForwardOptions()
        self.family = region_family(self.options.tiles)
        self._cache: dict[bytes, Schedule] = {}

    def __call__(self, x: torch.Tensor, routing: Routing, fault: Fault | None = None,
                 agreed: bool = False) -> ForwardOutput:
        """x: [T, H] spec.dtype this rank's tokens; routing: their ids/weights [T, k].
        agreed: the caller's call agreement has checked every rank's input and
        snapshotted the counters (``Session.open_call``): the region opens no agreement
        of its own."""
        spec, s, tiles = self.weights.spec, self.session, self.options.tiles
        marks = [time.perf_counter()]
        tokens = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() > 0 else -1
        fam = self.family
        if agreed:
            s.regions += 1
            n = s.regions
        else:
            n = s.agree(fam.forward_kind, self.weights, tokens, tiles, region_input_error(x, routing, spec))
        if fault is not None:
            fault.before_exchange(s.rank, n)
        par = ParallelSpec(ep=s.world, tokens_per_rank=tokens, nodes=self.options.nodes)
        s.transport.begin()
        if fam.reads_every_rank:
            routing = exchange_routing(routing, s.collectives, f"forward region {n}: routing exchange")
            plan, key = plan_routing(routing.ids, spec, par, agreed), routing.ids.numpy().tobytes()
        else:
            counts = exchange_tile_counts(routing.ids, spec.experts, tiles.rows, s.collectives,
                                          f"forward region {n}: count exchange")
            plan = plan_from_tile_counts(routing.ids, counts, spec, par, s.rank, tiles.rows, agreed)
            key = counts.numpy().tobytes()
        marks.append(time.perf_counter())
        layout = fam.layout(plan, tiles)
        region = fam.forward(layout)
        schedule = self._schedule(plan, key, region)
        program = compile_program(schedule, region, s.rank)
        program, region = fault.apply(program, region) if fault else (program, region)
        marks.append(time.perf_counter())
        sym = s.transport.prepare(Step(region, plan, tiles, schedule, program))
        buffers = fam.forward_buffers(x, layout, tiles, s.rank, sym)
        ctx = fam.forward_context(self.weights, layout, routing, s.rank)
        marks.append(time.perf_counter())
        s.board.enter(f"forward region {n}: run", publish=False)
        result = s.executor.run(program, region, buffers, ctx, s.transport)
        s.board.enter(f"forward region {n}: done", publish=False)
        marks.append(time.perf_counter())
        times = StepTimes(*np.diff(marks).tolist())
        return ForwardOutput(out=buffers.out, buffers=buffers, plan=plan, schedule=schedule, program=program,
                             timeline=result.timeline, times=times, routing=routing)

    def _schedule(self, plan: RoutingPlan, key: bytes, region: Region) -> Schedule:
        o = self.options
        key = key + bytes(str(plan.par), "ascii")
        if o.cache_schedules and key in self._cache:
            return self._cache[key]
        schedule = compile_region(plan, region, o.tiles, o.policy, o.hardware)
        if o.cache_schedules:
            self._cache = {key: schedule}
        return schedule


def region_input_error(x: object, routing: Routing, spec: MoESpec) -> BaseException | None:
    """``routing.input_error``, and a region needs at least one token."""
    error = input_error(x, routing, spec)
    if error is None and x.shape[0] == 0:
        return ValueError("x has no tokens (0 rows)")
    return error

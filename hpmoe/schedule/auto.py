"""``SchedulePolicy.AUTO``: forecast every way to run a region, run the fastest.

Candidates: the taskflow under each scheduling policy, the kernel-by-kernel path
(``exec.kernel_by_kernel``) and the serialized baseline (``refs``).  Each is forecast
as its modelled region time on the calibrated ``HardwareModel`` plus its measured
per-step setup (lowering, scheduling, count exchange).  The *fallback* is the faster
of the two kernel-by-kernel paths (the kernel-by-kernel path and the baseline); a
taskflow runs only when it is forecast at least ``MIN_GAIN`` faster than the fallback
and, when warm-up times are given, was measured faster than it too.

``decide`` is a pure function of the forecasts (tested on hand-made ones); building
the forecasts is the caller's part (``auto_forecasts`` for one process,
``runtime_forecasts`` for the multi-rank runtime; ``layer_decision`` picks and makes
them).  ``DecisionCache`` keeps one decision per routing shape: what ``hpmoe.MoE``,
``moe_forward`` and ``hpmoe bench`` consult.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import pickle
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..comm import Collectives
from ..ir.schedule import SchedulePolicy, WorkerCounts
from ..regions.family import region_family
from ..routing import RoutingKind, RoutingPlan, plan_routing, synthetic_routing
from ..sim.forecast import forecast_region, kernel_by_kernel_tiles, sequential_seconds
from ..sim.hardware import HardwareModel
from ..sim.profile import load_profile
from ..spec import MoESpec, ParallelSpec, TileSpec
from .hyperparallel import hyperparallel_schedule
from .serial import serial_schedule

MIN_GAIN = 1.05  # a taskflow must be forecast this much faster than the fallback


class Path(enum.Enum):
    """How a region runs."""

    TASKFLOW = "taskflow"  # tile tasks under a scheduling policy
    KERNEL_BY_KERNEL = "kernel-by-kernel"  # exec.kernel_by_kernel: grouped GEMMs per phase
    PERSISTENT = "persistent"  # hpmoe.gpu: the taskflow as one persistent Triton kernel
    BASELINE = "baseline"  # refs: serialized_ep_forward / dense_moe


@dataclass(frozen=True)
class Candidate:
    """One way to run the region; ``policy`` only for a taskflow."""

    path: Path
    policy: SchedulePolicy | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, Path):
            raise TypeError(f"Candidate.path must be a Path, got {self.path!r}")
        taskflow = self.path is Path.TASKFLOW
        if taskflow != isinstance(self.policy, SchedulePolicy) or self.policy is SchedulePolicy.AUTO:
            raise ValueError(f"Candidate.policy={self.policy!r} with path={self.path.value}: a taskflow "
                             "needs a concrete SchedulePolicy, the other paths none")

    @property
    def name(self) -> str:
        return f"{self.path.value}:{self.policy.value}" if self.policy is not None else self.path.value

    @property
    def is_fallback(self) -> bool:
        return self.path is not Path.TASKFLOW


KERNEL_BY_KERNEL = Candidate(Path.KERNEL_BY_KERNEL)
BASELINE = Candidate(Path.BASELINE)


@dataclass(frozen=True)
class Forecast:
    """A candidate's forecast: ``region_s`` modelled on the hardware model, ``setup_s``
    measured per-step setup; seconds."""

    candidate: Candidate
    region_s: float
    setup_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("region_s", "setup_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Forecast.{name} must be a finite number >= 0, got {value!r}")

    @property
    def total_s(self) -> float:
        return self.region_s + self.setup_s


class Reason(enum.Enum):
    """Why ``decide`` chose what it chose."""

    FALLBACK_FASTEST = "fallback-fastest"  # no taskflow is forecast faster than the fallback
    GAIN_BELOW_MIN = "gain-below-min"  # the best taskflow's forecast gain is under MIN_GAIN
    VETOED = "vetoed-by-warm-up"  # forecast to pay, measured no faster than the fallback
    FORECAST_GAIN = "forecast-gain"  # a taskflow forecast >= MIN_GAIN faster, not vetoed
    NO_MODEL = "no-model"  # no calibrated hardware model: the fallback, unforecast
    NO_TOKENS = "no-tokens"  # nothing to run: the fallback, unforecast


@dataclass(frozen=True)
class AutoDecision:
    """What AUTO runs (``chosen``), the path it falls back to (``fallback``), every
    forecast, the warm-up seconds it was checked against (by candidate name), the best
    taskflow's forecast gain over the fallback (1.0 when there is none) and why."""

    chosen: Candidate
    fallback: Candidate
    forecasts: tuple[Forecast, ...]
    reason: Reason
    gain: float = 1.0
    measured_s: Mapping[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        if not self.forecasts:  # no model, or nothing to run
            return f"{self.chosen.name} ({self.reason.value}: nothing forecast)"
        parts = ", ".join(f"{f.candidate.name} {f.total_s * 1e3:.3f} ms" for f in self.forecasts)
        return (f"{self.chosen.name} ({self.reason.value}; forecast gain of the best taskflow over "
                f"{self.fallback.name} {self.gain:.2f}x; forecasts: {parts})")

    def to_json(self) -> dict:
        out = {"auto_chosen": self.chosen.name, "auto_reason": self.reason.value,
               "auto_fallback": self.fallback.name, "auto_forecast_gain": round(self.gain, 3)}
        out |= {f"forecast_{f.candidate.name}_ms": round(f.total_s * 1e3, 3) for f in self.forecasts}
        return out | {f"warmup_{n}_ms": round(s * 1e3, 3) for n, s in self.measured_s.items()}


def decide(forecasts: Sequence[Forecast], measured_s: Mapping[str, float] | None = None,
           min_gain: float = MIN_GAIN) -> AutoDecision:
    """AUTO's choice among ``forecasts`` (at least one kernel-by-kernel or baseline).

    1. fallback: the fastest non-taskflow forecast (ties: the earlier one);
    2. best: the fastest taskflow; none, or not faster than the fallback: the fallback;
    3. forecast gain (fallback / best) under ``min_gain``: the fallback;
    4. ``measured_s`` (warm-up seconds by candidate name) holds both and the best ran
       no faster than the fallback: the fallback (vetoed); else the best taskflow."""
    if not isinstance(min_gain, int | float) or not min_gain >= 1.0:
        raise ValueError(f"min_gain must be a number >= 1, got {min_gain!r}")
    measured = dict(measured_s or {})
    fallbacks = [f for f in forecasts if f.candidate.is_fallback]
    if not fallbacks:
        raise ValueError(f"forecasts must include the kernel-by-kernel path or the baseline, got "
                         f"{[f.candidate.name for f in forecasts]}")
    fb = min(fallbacks, key=lambda f: f.total_s)
    flows = [f for f in forecasts if not f.candidate.is_fallback]
    best = min(flows, key=lambda f: f.total_s) if flows else None
    every = tuple(forecasts)
    if best is None or best.total_s >= fb.total_s:
        return AutoDecision(fb.candidate, fb.candidate, every, Reason.FALLBACK_FASTEST, 1.0, measured)
    gain = fb.total_s / best.total_s if best.total_s > 0 else math.inf
    reason = Reason.FORECAST_GAIN
    if gain < min_gain:
        reason = Reason.GAIN_BELOW_MIN
    elif _vetoed(measured, best.candidate, fb.candidate):
        reason = Reason.VETOED
    chosen = best.candidate if reason is Reason.FORECAST_GAIN else fb.candidate
    return AutoDecision(chosen, fb.candidate, every, reason, gain, measured)


def _vetoed(measured: Mapping[str, float], best: Candidate, fallback: Candidate) -> bool:
    if best.name not in measured or fallback.name not in measured:
        return False
    return measured[best.name] >= measured[fallback.name]


def no_model(fallback: Candidate = KERNEL_BY_KERNEL) -> AutoDecision:
    """The decision without a calibrated hardware model: the fallback, unforecast."""
    return AutoDecision(fallback, fallback, (), Reason.NO_MODEL)


# ---------------------------------------------------------------------------- cache


@dataclass(frozen=True)
class RoutingShape:
    """What a decision depends on besides the hardware: the layer, the EP size, the
    tokens per rank and whether the backward runs too."""

    moe: MoESpec
    ep: int
    tokens_per_rank: int
    backward: bool

    @staticmethod
    def one_process(moe: MoESpec, ep: int, tokens: int, backward: bool = False) -> RoutingShape:
        """The shape of ``tokens`` split over ``ep`` virtual ranks in one process; raises
        ``ValueError`` naming ``ep`` when it does not divide the tokens or the experts."""
        if not isinstance(ep, int) or isinstance(ep, bool) or ep <= 0 or tokens % ep:
            raise ValueError(f"ep={ep!r} must be a positive int dividing the {tokens} tokens")
        ParallelSpec(ep=ep, tokens_per_rank=max(1, tokens // ep)).local_experts(moe)
        return RoutingShape(moe, ep, tokens // ep, backward)


class DecisionCache:
    """AUTO's decisions, one per (routing shape, tiles, hardware, workers)."""

    def __init__(self) -> None:
        self._decisions: dict[tuple, AutoDecision] = {}

    def decide(self, shape: RoutingShape, tiles: TileSpec, hardware: HardwareModel | None,
               workers: WorkerCounts | None = None, coll: Collectives | None = None) -> AutoDecision:
        """The cached decision, or ``layer_decision``'s (collective over ``coll``: every
        rank must ask for the same shape); ``hardware`` None: the saved cpu profile."""
        key = (shape, tiles, hardware, workers)
        if key not in self._decisions:
            model = hardware if hardware is not None else saved_profile()
            self._decisions[key] = layer_decision(shape, tiles, model, workers, coll)
        return self._decisions[key]

    def __len__(self) -> int:
        return len(self._decisions)


PROCESS_DECISIONS = DecisionCache()  # the decisions of callers that keep none (moe_forward, compiled layers)


def saved_profile() -> HardwareModel | None:
    """The calibrated cpu profile (``hpmoe calibrate``), or None when none is saved."""
    try:
        return load_profile()
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------------------- one process


def auto_forecasts(plan: RoutingPlan, tiles: TileSpec, hardware: HardwareModel,
                   backward: bool) -> tuple[Forecast, ...]:
    """Forecasts of the one-process candidates of ``plan``: the exact executor's taskflow
    (its tasks one after another on one thread, plus its lowering, measured here) and
    the kernel-by-kernel path (its kernels as whole-region tasks, one after another).
    With ``backward`` the backward region is added to both."""
    flow, setup = _timed_graphs(plan, tiles, backward)
    kbk, _ = _timed_graphs(plan, kernel_by_kernel_tiles(plan), backward)
    return (Forecast(Candidate(Path.TASKFLOW, SchedulePolicy.SERIAL), sum(sequential_seconds(g, hardware)
                                                                         for g in flow), setup),
            Forecast(KERNEL_BY_KERNEL, sum(sequential_seconds(g, hardware) for g in kbk)))


def _timed_graphs(plan: RoutingPlan, tiles: TileSpec, backward: bool) -> tuple[list, float]:
    t0 = time.perf_counter()
    graphs = _graphs(plan, tiles, backward)
    return graphs, time.perf_counter() - t0


# ---------------------------------------------------------------------------- ranks


def runtime_forecasts(plan: RoutingPlan, tiles: TileSpec, hardware: HardwareModel, workers: WorkerCounts,
                      backward: bool) -> tuple[Forecast, ...]:
    """Forecasts of the multi-rank candidates of ``plan``: the taskflow under
    HYPERPARALLEL on the runtime's workers (plus its lowering and scheduling, measured
    here) and the kernel-by-kernel path as the serial schedule of its whole-phase tasks
    on one worker per unit; both replayed by ``forecast_region`` on ``hardware``."""
    t0 = time.perf_counter()
    flow = [hyperparallel_schedule(g, workers) for g in _graphs(plan, tiles, backward)]
    setup = time.perf_counter() - t0
    hw = dataclasses.replace(hardware, matrix_workers=workers.matrix, vector_workers=workers.vector)
    return (Forecast(Candidate(Path.TASKFLOW, SchedulePolicy.HYPERPARALLEL),
                     sum(forecast_region(s, hw)[0] for s in flow), setup),
            kernel_by_kernel_forecast(plan, hardware, backward))


def kernel_by_kernel_forecast(plan: RoutingPlan, hardware: HardwareModel, backward: bool = False,
                              setup_s: float = 0.0) -> Forecast:
    """The kernel-by-kernel path of ``plan`` across ranks: the serial schedule of its
    whole-phase tasks on one worker per unit, replayed by ``forecast_region`` on
    ``hardware``; ``setup_s`` (e.g. a measured count exchange) added."""
    one = WorkerCounts(1, 1)  # torch kernels called in turn: no executor to launch
    hw1 = dataclasses.replace(hardware, matrix_workers=1, vector_workers=1, launch_overhead=0.0)
    kbk = [serial_schedule(g, one) for g in _graphs(plan, kernel_by_kernel_tiles(plan), backward)]
    return Forecast(KERNEL_BY_KERNEL, sum(forecast_region(s, hw1)[0] for s in kbk), setup_s)


def _graphs(plan: RoutingPlan, tiles: TileSpec, backward: bool) -> list:
    """The taskflow's graphs: the deduplicated regions' under deduplicated tiles (on the
    shape plan's one node)."""
    family = region_family(tiles)
    layout = family.layout(plan, tiles)
    regions = [family.forward(layout)] + ([family.backward(layout, False)] if backward else [])
    return [r.graph(plan, tiles) for r in regions]


def shape_plan(shape: RoutingShape) -> RoutingPlan:
    """A balanced routing of ``shape``: what a layer's decision is forecast on (the
    decision is made once per shape, before any routing of it is known)."""
    par = ParallelSpec(shape.ep, shape.tokens_per_rank)
    return plan_routing(synthetic_routing(RoutingKind.BALANCED, shape.moe, par).ids, shape.moe, par)


def layer_decision(shape: RoutingShape, tiles: TileSpec, hardware: HardwareModel | None,
                   workers: WorkerCounts | None = None, coll: Collectives | None = None) -> AutoDecision:
    """AUTO's decision for a layer: one process (``workers`` None) or the multi-rank
    runtime with ``workers`` per rank; with ``coll`` (an EP group's deadline-bounded
    collectives) group rank 0 decides and every rank gets its decision."""
    decision = None
    if coll is None or coll.rank == 0:
        if hardware is None:
            decision = no_model()
        elif shape.tokens_per_rank == 0:
            decision = AutoDecision(KERNEL_BY_KERNEL, KERNEL_BY_KERNEL, (), Reason.NO_TOKENS)
        else:
            plan = shape_plan(shape)
            forecasts = (auto_forecasts(plan, tiles, hardware, shape.backward) if workers is None else
                         runtime_forecasts(plan, tiles, hardware, workers, shape.backward))
            decision = decide(forecasts)
    if coll is None:
        return decision
    shared = coll.broadcast_bytes(pickle.dumps(decision) if coll.rank == 0 else None, "AUTO decision")
    return pickle.loads(shared)

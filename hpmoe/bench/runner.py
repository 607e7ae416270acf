"""Dispatch-to-Combine latency on identical inputs: the serialized torch.distributed
baseline, the kernel-by-kernel path, the serial schedule on hpmoe's runtime, the
runtime taskflow, and what a user's layer runs by default (``taskflow`` in the report).

Plan of ``run_bench`` (every rank, collectively):
  1. every rank builds the same global batch from the seed and keeps its slice;
  2. with a saved cpu profile, the cost models (``bench.forecast``): calibrated
     profile + measured link and executor overhead, agreed by all ranks;
  3. warm-up iterations of every variant; with the cost models, the forecast of every
     candidate (``schedule.auto.decide``: reported; AUTO's tuning measures its choice
     first);
  4. the default path: ``hpmoe.MoE`` on the bench's session, called on the bench's
     routing through the front door of every call (agreement, ``engine.select``);
     under AUTO its first calls tune (``schedule.tuner``) or read the tuning cache; the
     runtime taskflow variant then runs the tuned taskflow (else the runner-up, else
     the space's default) for its per-step times and timeline;
  5. timed iterations, variants interleaved in a balanced order (``bench.order``:
     each variant runs right after each other one equally often) or in blocks, each
     after a barrier; a variant's time in an iteration is the slowest rank's; medians
     and quartiles over them.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..engine.options import RegionOptions
from ..engine.selection import knob_options
from ..exec.backend import Backend
from ..ir.schedule import SchedulePolicy, WorkerCounts
from ..launch.netns import LinkSpec
from ..nn.layer import MoE
from ..placement import place_on_load
from ..refs import serialized_ep_forward
from ..routing import Routing, RoutingKind, synthetic_routing
from ..runtime.collective import CollectiveError
from ..runtime.faults import Fault
from ..runtime.forensics import RegionError
from ..runtime.forward import ForwardOptions, ForwardOutput, ForwardRunner
from ..runtime.session import RuntimeConfig, Session
from ..runtime.transport.segment import SegmentError
from ..schedule.auto import (
    BASELINE,
    KERNEL_BY_KERNEL,
    AutoDecision,
    Candidate,
    Forecast,
    Path,
    decide,
    kernel_by_kernel_forecast,
    no_model,
)
from ..schedule.tune import KERNEL_BY_KERNEL_KNOBS, Budget, Knobs, Space, TuneResult
from ..sim.forecast import forecast_region
from ..sim.hardware import HardwareModel
from ..sim.presets import cpu_nominal
from ..spec import MoESpec, ParallelSpec, TileSpec
from ..weights import ExpertWeights
from .forecast import Models, ShareProbe, agreed_models, agreed_profile, slowest_rank
from .order import IterationOrder, run_groups
from .overhead import host_ticks, steal_fraction
from .report import BenchReport, Stats, all_equal, max_abs_diff, measured_timeline, predict


class Variant(enum.Enum):
    SERIAL = "serial"  # refs.serialized_ep_forward: all_to_all_single, kernel by kernel
    KERNEL_BY_KERNEL = "kernel_by_kernel"  # exec.kernel_by_kernel: the same phases on grouped GEMMs
    SERIAL_SAME_TRANSPORT = "serial_same_transport"  # serial schedule, hpmoe runtime + transport
    RUNTIME = "runtime_taskflow"  # the chosen schedule on hpmoe's runtime
    TASKFLOW = "taskflow"  # what hpmoe runs by default (AUTO's choice)
    UNBALANCED = "unbalanced"  # under ``balance`` only: the default path's layer without the placement


STEP_NAMES = ("exchange", "schedule", "prepare", "region")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: the layer, its inputs, the runtime (its transport, and its worker
    threads per rank: the hardware model's worker counts) and the measurement."""

    moe: MoESpec
    tokens: int
    routing: RoutingKind
    seed: int
    tiles: TileSpec
    runtime: RuntimeConfig
    workers: WorkerCounts
    policy: SchedulePolicy  # AUTO: the cost model picks among every path
    warmup: int = 5
    iters: int = 10
    link: LinkSpec | None = None
    predict: bool = False
    cache_schedules: bool = False
    fault: Fault | None = None
    sweep: bool = False  # also time every candidate of the tuning space (``schedule.tune.Space.every``)
    order: IterationOrder = IterationOrder.BALANCED  # how the timed calls of the variants interleave
    block: int = 10  # back-to-back calls of a variant under IterationOrder.BLOCKS
    balance: int | None = None  # redundant slots of a placement planned on the batch's load (0: re-pack only)
    paired: int = 0  # with ``sweep``: then calls each of the default and the sweep's fastest candidate
    backend: Backend = Backend.EXACT  # the default's path: EXACT under ``policy``, or KERNEL_BY_KERNEL pinned

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.iters <= 0:
            raise ValueError(f"BenchConfig.warmup={self.warmup} must be >= 1 (the cost model reads "
                             f"it) and BenchConfig.iters={self.iters} > 0")
        if not isinstance(self.order, IterationOrder) or self.block < 1:
            raise ValueError(f"BenchConfig.order={self.order!r} must be an IterationOrder and "
                             f"BenchConfig.block={self.block!r} >= 1")
        if self.paired < 0 or (self.paired and not self.sweep):
            raise ValueError(f"BenchConfig.paired={self.paired!r} must be >= 0, and needs sweep (it pairs "
                             f"the default with the sweep's fastest candidate)")
        if self.backend not in (Backend.EXACT, Backend.KERNEL_BY_KERNEL):
            raise ValueError(f"BenchConfig.backend={self.backend!r} must be Backend.EXACT or "
                             f"Backend.KERNEL_BY_KERNEL (a bench runs ranks on the CPU)")
        if self.backend is Backend.KERNEL_BY_KERNEL and self.policy is not SchedulePolicy.AUTO:
            raise ValueError(f"--backend kernel_by_kernel runs no schedule: --schedule={self.policy.value} "
                             f"must be left at auto")

    @property
    def tunes(self) -> bool:
        """Whether the default path is AUTO's, which tunes on its first calls."""
        return self.policy is SchedulePolicy.AUTO and self.backend is Backend.EXACT


@dataclass(frozen=True)
class Inputs:
    """This rank's slice of the global batch, and the layer's weights."""

    x: torch.Tensor
    routing: Routing
    weights: ExpertWeights


def make_inputs(config: BenchConfig, world: int, rank: int) -> Inputs:
    """The same global batch on every rank (from ``config.seed``); this rank's slice.
    Under ``config.balance`` the routing and weights are the physical layer's (one expert
    per slot of the placement planned on this batch's load)."""
    moe, t = config.moe, config.tokens
    par = ParallelSpec(ep=world, tokens_per_rank=t)
    par.local_experts(moe)
    g = torch.Generator().manual_seed(config.seed)
    x = torch.randn(world * t, moe.hidden, generator=g, device="cpu").to(moe.dtype)
    weights = ExpertWeights.random(moe, seed=config.seed)
    r = synthetic_routing(config.routing, moe, par, seed=config.seed)
    if config.balance is not None:
        r, _, placement = place_on_load(r, moe, par, config.balance)
        weights = placement.physical_weights(weights)
    mine = slice(rank * t, (rank + 1) * t)
    routing = Routing(r.ids[mine].contiguous(), r.weights[mine].contiguous())
    return Inputs(x=x[mine].contiguous(), routing=routing, weights=weights)


@dataclass
class Samples:
    """Per variant name: seconds of each iteration on this rank, the last output, and
    (runtime variants) each iteration's step times and the last ``ForwardOutput``."""

    seconds: dict[str, list[float]]
    outs: dict[str, torch.Tensor]
    steps: dict[str, list[tuple[float, float, float, float]]]
    last: dict[str, ForwardOutput]
    probe: list[float]  # ShareProbe windows, one per iteration (seconds per tile call)
    entries: dict[str, list[int]]  # runtime variants: when this rank entered each region (perf_counter_ns)
    kernels: dict[str, list[tuple[np.ndarray, np.ndarray]]]  # runtime variants: (task ids, kernel CPU s)

    @staticmethod
    def empty(names: list[str]) -> Samples:
        return Samples({n: [] for n in names}, {}, {n: [] for n in names}, {}, [], {n: [] for n in names},
                       {n: [] for n in names})

    def record(self, name: str, res: object, seconds: float) -> None:
        if isinstance(res, ForwardOutput):
            self.outs[name], self.last[name] = res.out.clone(), res
            t = res.times
            self.steps[name].append((t.exchange_s, t.schedule_s, t.prepare_s, t.region_s))
            self.entries[name].append(res.timeline.origin_ns)
            self.kernels[name].append((res.program.task_ids[res.timeline.task], res.timeline.cpu))
        else:
            self.outs[name] = res.out
        self.seconds[name].append(seconds)

    def alias(self, name: str, to: str) -> None:
        self.seconds[name], self.outs[name] = self.seconds[to], self.outs[to]

    def entry_offsets(self, name: str, group: dist.ProcessGroup | None) -> np.ndarray:
        """[iterations, ranks] seconds each rank entered ``name``'s region after the first
        rank did (ranks of one host share the clock).  Collective."""
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, self.entries[name], group=group)
        ns = np.array(parts, dtype=np.int64).T
        return (ns - ns.min(axis=1, keepdims=True)) / 1e9

    def kernel_cpu(self, name: str, num_tasks: int, group: dist.ProcessGroup | None) -> np.ndarray:
        """[iterations, num_tasks] every rank's tasks' kernel CPU seconds in each of
        ``name``'s regions (``RunTimeline.cpu``; each task runs on one rank).  Collective."""
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, self.kernels[name], group=group)
        rows = np.zeros((len(self.kernels[name]), num_tasks))
        for rank_rows in parts:
            for row, (ids, cpu) in zip(rows, rank_rows, strict=True):
                row[ids] = cpu
        return rows

    def step_medians(self, name: str, group: dist.ProcessGroup | None) -> dict[str, float]:
        """Median seconds of each step of ``name`` (slowest rank per iteration)."""
        rows = slowest_rank(np.array(self.steps[name]), group)
        return dict(zip(STEP_NAMES, np.median(rows, axis=0).tolist(), strict=True))


Calls = dict[str, Callable[[], object]]


def candidate_policies(policy: SchedulePolicy,
                       profile: HardwareModel | None) -> tuple[list[SchedulePolicy], str]:
    """The runtime schedules to try for ``policy`` (AUTO: the taskflow policies it weighs)
    and a note."""
    if profile is None:
        if policy in (SchedulePolicy.AUTO, SchedulePolicy.CRITICAL_PATH):
            return [SchedulePolicy.HYPERPARALLEL], ("no cpu profile: nothing forecast; AUTO chose by "
                                                   "measuring (the tuning fields)")
        return [policy], ""
    if policy is SchedulePolicy.AUTO:
        return [SchedulePolicy.CRITICAL_PATH, SchedulePolicy.HYPERPARALLEL], ""
    return [policy], ""


def runtime_name(policy: SchedulePolicy) -> str:
    return f"runtime:{policy.value}"


def make_calls(config: BenchConfig, session: Session, data: Inputs, hardware: HardwareModel,
               policies: list[SchedulePolicy]) -> Calls:
    """The baseline, kernel by kernel (a layer pinned to it: the front door, as a user
    runs it), the serial schedule, and one bare runtime call per candidate policy."""
    def runtime(policy: SchedulePolicy) -> Callable[[], object]:
        knobs = Knobs(Path.TASKFLOW, policy, hardware.workers, config.tiles)
        return runtime_call(config, session, data, knobs, hardware)

    group, pinned = session.group, RegionOptions(ep_group=session, backend=Backend.KERNEL_BY_KERNEL)
    calls: Calls = {Variant.SERIAL.value: lambda: serialized_ep_forward(data.x, data.weights, data.routing,
                                                                        group),
                    Variant.KERNEL_BY_KERNEL.value: layer_call(data, pinned)[1],
                    Variant.SERIAL_SAME_TRANSPORT.value: runtime(SchedulePolicy.SERIAL)}
    return calls | {runtime_name(p): runtime(p) for p in policies}


def layer_call(data: Inputs, options: RegionOptions) -> tuple[MoE, Callable[[], object]]:
    """``hpmoe.MoE`` of the bench's weights under ``options``, called on the bench's
    routing: every call through the front door (agreement, ``engine.select``)."""
    w = data.weights
    layer = MoE(w.spec, w, **{f.name: getattr(options, f.name) for f in dataclasses.fields(options)})
    return layer, lambda: Output(layer.region(data.x, data.routing.ids, data.routing.weights))


def runtime_call(config: BenchConfig, session: Session, data: Inputs, knobs: Knobs,
                 hardware: HardwareModel) -> Callable[[], object]:
    """A bare runtime call (``ForwardRunner``, its ``ForwardOutput`` with per-step times
    and timeline; the bench's ``--fault``) of the taskflow ``knobs``: its policy, tiles
    and worker threads at ``hardware``'s rates."""
    w = knobs.workers
    hw = dataclasses.replace(hardware, matrix_workers=w.matrix, vector_workers=w.vector)
    runner = ForwardRunner(session, data.weights, ForwardOptions(
        tiles=knobs.tiles, policy=knobs.policy, hardware=hw, cache_schedules=config.cache_schedules))
    return lambda: runner(data.x, data.routing, config.fault)


@dataclass(frozen=True)
class Output:
    out: torch.Tensor


PROBE_SETTLE_S, PROBE_WINDOW_S = 0.05, 0.1


def timed_loop(iters: int, calls: Calls, session: Session, phase: str,
               probe: ShareProbe | None = None, order: IterationOrder = IterationOrder.BALANCED,
               block: int = 1) -> Samples:
    """``iters`` calls of each of ``calls``, each after a barrier (under the session's
    deadline, announced on its board), in the groups of ``run_groups``: one call of each
    per iteration in the rows of ``iteration_order`` (every call follows every other one
    equally often), or blocks of ``block`` back-to-back calls; with ``probe``, a window of
    it after each group (every rank at once), so that the host's speed is measured over
    the same minutes as the calls; rank 0 shows progress on stderr (at most one line a
    second, and the last)."""
    s = Samples.empty(list(calls))
    names = list(calls)
    start = shown = time.monotonic()
    groups = run_groups(names, iters, order, block)
    iters = len(groups)
    for i, group in enumerate(groups):
        for name in group:
            call = calls[name]
            session.collectives.barrier(f"{phase} {i + 1}/{iters}: barrier before {name}", publish=False)
            session.board.enter(f"{phase} {i + 1}/{iters}: {name}", publish=False)
            t0 = time.perf_counter()
            res = call()
            s.record(name, res, time.perf_counter() - t0)
        if probe is not None:
            session.collectives.barrier(f"{phase} {i + 1}/{iters}: barrier before the share probe",
                                        publish=False)
            s.probe.append(probe.window(PROBE_WINDOW_S, settle=PROBE_SETTLE_S))
        if session.rank == 0 and (time.monotonic() - shown > 1.0 or i + 1 == iters):
            shown = time.monotonic()
            print(f"hpmoe bench: {phase} {i + 1}/{iters} ({shown - start:.1f} s)", file=sys.stderr,
                  flush=True)
    return s


def run_bench(config: BenchConfig, group: dist.ProcessGroup | None = None) -> BenchReport:
    """Run the benchmark on every rank of ``group`` (collective); same report everywhere.
    A collective of the group that fails (its timeout should be the runtime's
    deadline) ends in a ``CollectiveError`` naming the ranks that did not arrive."""
    data = make_inputs(config, dist.get_world_size(group), dist.get_rank(group))
    torch.set_num_threads(config.runtime.threads)  # the baseline's intra-op threads
    with torch.no_grad(), Session(config.runtime, group) as session:
        try:
            return _run(config, session, data)
        except (CollectiveError, RegionError, SegmentError):
            raise
        except RuntimeError as err:  # a collective of torch.distributed timed out or lost a peer
            raise CollectiveError(session.collectives.diagnose_current(err)) from err


def _run(config: BenchConfig, session: Session, data: Inputs) -> BenchReport:
    group = session.group
    session.board.enter("bench: profile agreement")
    profile = agreed_profile(group)
    policies, note = candidate_policies(config.policy, profile)
    note = note if config.tunes else ""  # its note is on AUTO's choice
    session.board.enter("bench: cost model measurements")
    models = bench_models(config, profile, group)
    hardware = models.runtime if models else cpu_nominal(config.workers.matrix, config.workers.vector)
    every = make_calls(config, session, data, hardware, policies)
    warm = timed_loop(config.warmup, every, session, "warm-up")
    session.board.enter("bench: decision")
    decision = _decide(warm, models, policies, group) if config.policy is SchedulePolicy.AUTO else None
    calls = {n: c for n, c in every.items() if not n.startswith("runtime:")}
    tuned, aliases = add_default(config, session, data, hardware, calls)  # a variant run once has aliases
    unbalanced, unbalanced_fields = unbalanced_call(config, session, hardware)
    calls |= unbalanced
    if tuned is not None:
        flow = _runtime_knobs(tuned.result, config.tiles)
        chosen = flow.policy
        calls[Variant.RUNTIME.value] = runtime_call(config, session, data, flow, hardware)
        if config.sweep:
            knob = KnobCalls(session, data, hardware, every)
            aliases |= {sweep_name(KERNEL_BY_KERNEL_KNOBS): Variant.KERNEL_BY_KERNEL.value}
            calls |= {sweep_name(k): knob(k) for k in tuned.space.every() if sweep_name(k) not in aliases}
    else:
        chosen = policies[0]
        calls[Variant.RUNTIME.value] = every[runtime_name(chosen)]
    probe = models.probe if config.predict and models is not None else None
    ticks = host_ticks()
    samples = timed_loop(config.iters, calls, session, "iteration", probe, config.order, config.block)
    steal = steal_fraction(ticks, host_ticks())
    for name, to in aliases.items():
        samples.alias(name, to)
    paired = head_to_head(config.paired, calls, aliases, samples, session) if config.paired and tuned else {}
    session.board.enter("bench: report")
    report = build_report(config, chosen, samples, models, decision, group, note, probe,
                          _max_or_none(steal, group), tuned, paired)
    return dataclasses.replace(report, tuning=report.tuning | unbalanced_fields)


def add_default(config: BenchConfig, session: Session, data: Inputs, hardware: HardwareModel,
                calls: Calls) -> tuple[Tuned | None, dict[str, str]]:
    """Add the default path's call to ``calls``, settled (``settle``: under AUTO, tuned);
    its tuning, and the aliases of variants timed once: under ``Backend.KERNEL_BY_KERNEL``
    the default is the kernel-by-kernel variant.  Collective."""
    if config.backend is Backend.KERNEL_BY_KERNEL:
        return None, {Variant.TASKFLOW.value: Variant.KERNEL_BY_KERNEL.value}
    layer, calls[Variant.TASKFLOW.value] = default_call(config, session, data, hardware)
    return settle(layer, calls[Variant.TASKFLOW.value], config, session), {}


def unbalanced_call(config: BenchConfig, session: Session, hardware: HardwareModel) -> tuple[Calls, dict]:
    """Under ``config.balance``: the default path's layer on the same batch without the
    placement (the logical layer, its experts where the routing put them), warmed up and
    tuned like the default, and its tuning's winner; else nothing.  Collective."""
    if config.balance is None:
        return {}, {}
    plain = make_inputs(dataclasses.replace(config, balance=None), session.world, session.rank)
    layer, call = default_call(config, session, plain, hardware)
    tuned = settle(layer, call, config, session)
    return {Variant.UNBALANCED.value: call}, ({"unbalanced_tune_winner": tuned.result.winner.name}
                                              if tuned is not None else {})


def head_to_head(calls_each: int, calls: Calls, aliases: dict[str, str], samples: Samples,
                 session: Session) -> dict[str, Stats]:
    """The default against the sweep's fastest candidate (its fastest iteration, the
    slowest rank's), ``calls_each`` calls of each alternating call by call: a paired
    comparison, which the host's drift over the sweep's minutes does not bias.  Keyed by
    ``taskflow`` and the candidate's sweep name.  Collective."""
    group = session.group
    fastest = {n: float(slowest_rank(np.array(samples.seconds[n]), group).min())
               for n in sorted(samples.seconds) if n.startswith("sweep:")}
    best = min(fastest, key=fastest.__getitem__)
    default = Variant.TASKFLOW.value
    pair = {default: calls[default], best: calls[aliases.get(best, best)]}
    s = timed_loop(calls_each, pair, session, "paired")
    return {n: Stats.of(slowest_rank(np.array(s.seconds[n]), group)) for n in pair}


# ---------------------------------------------------------------------------- tuning


def sweep_name(knobs: Knobs) -> str:
    return f"sweep:{knobs.name}"


class KnobCalls:
    """The bench's call of each candidate of the tuning space through the front door,
    made once on first use: a layer pinned to it (``engine.selection.knob_options``; the
    taskflow's worker threads at ``hardware``'s rates)."""

    def __init__(self, session: Session, data: Inputs, hardware: HardwareModel, known: Calls):
        self.session, self.data, self.hardware = session, data, hardware
        self.calls = {KERNEL_BY_KERNEL_KNOBS: known[Variant.KERNEL_BY_KERNEL.value]}

    def __call__(self, knobs: Knobs) -> Callable[[], object]:
        if knobs not in self.calls:
            options = knob_options(RegionOptions(ep_group=self.session), knobs, self.hardware)
            self.calls[knobs] = layer_call(self.data, options)[1]
        return self.calls[knobs]


@dataclass(frozen=True)
class Tuned:
    """The default path's tuning: the space, the layer's result and its notes (stale
    cache entries)."""

    space: Space
    result: TuneResult
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        r = self.result
        here = r.source == "measured"  # a cached choice cost this run nothing
        out = {"tune_winner": r.winner.name, "tune_winner_ms": round(r.winner_s * 1e3, 3),
               "tune_runner_up": r.runner_up.name if r.runner_up else None,
               "tune_gain_over_runner_up": round(r.gain_over_runner_up, 3),
               "tune_steps": r.steps if here else 0, "tune_seconds": round(r.seconds, 3) if here else 0.0,
               "tune_source": r.source,
               "tune_max_steps": Budget().max_steps}
        return out | ({"tune_note": "; ".join(self.notes)} if self.notes else {})


def default_call(config: BenchConfig, session: Session, data: Inputs,
                 hardware: HardwareModel) -> tuple[MoE, Callable[[], object]]:
    """What a user's layer runs by default (or under the bench's ``--schedule`` or
    ``--backend``)."""
    auto = config.policy is SchedulePolicy.AUTO
    return layer_call(data, RegionOptions(ep_group=session, schedule=config.policy, tiles=config.tiles,
                                          hardware=None if auto else hardware, backend=config.backend))


def settle(layer: MoE, call: Callable[[], object], config: BenchConfig, session: Session) -> Tuned | None:
    """Calls of the default path alone, back to back, until AUTO's tuning settles (a
    cached choice settles at once), and at least ``config.warmup`` of them; the tuning
    (None: the layer does not tune, its path fixed).  Collective."""
    auto = config.tunes
    for step in range(config.warmup + Budget().max_steps + 2):
        if step >= config.warmup and (not auto or layer.tuned(config.tokens, backward=False)):
            break
        session.collectives.barrier(f"default path {step + 1}: barrier", publish=False)
        session.board.enter(f"default path {step + 1}: {'tuning' if auto else 'warm-up'}", publish=False)
        call()
    if not auto:
        return None
    result = layer.tuned(config.tokens, backward=False)
    if result is None:
        raise RuntimeError(f"AUTO's tuning did not settle within {Budget().max_steps} calls "
                           f"(Budget.max_steps) of tokens={config.tokens}")
    return Tuned(Space.around(config.tiles, TileSpec(), 1), result, layer.tuning_notes)


def _runtime_knobs(result: TuneResult, tiles: TileSpec) -> Knobs:
    """What the report's runtime taskflow runs: the winner, else the runner-up, when a
    taskflow; else the space's default taskflow."""
    for k in (result.winner, result.runner_up):
        if k is not None and k.path is Path.TASKFLOW:
            return k
    return Space.around(tiles, TileSpec(), 1).default()


def _max_or_none(value: float | None, group: dist.ProcessGroup | None) -> float | None:
    """The largest ``value`` over the group's ranks; None when no rank has one.  Collective."""
    top = float(slowest_rank(np.array([-1.0 if value is None else value]), group)[0])
    return None if top < 0 else top


def bench_models(config: BenchConfig, profile: HardwareModel | None,
                 group: dist.ProcessGroup | None) -> Models | None:
    """The cost models (None without a profile); links measured with the bytes a
    rank sends each peer in a balanced dispatch (a shaped link's rate is known), the
    put CPU with puts of one vector tile's rows.  Collective."""
    if profile is None:
        return None
    moe, world = config.moe, dist.get_world_size(group)
    nbytes = max(64, config.tokens * moe.top_k * moe.hidden * moe.dtype.itemsize // world)
    rate = config.link.bytes_per_s if config.link is not None else None
    put_bytes = config.tiles.rows * moe.hidden * moe.dtype.itemsize
    return agreed_models(profile, config.runtime, config.workers, moe.dtype, nbytes, put_bytes, group, rate)


def _decide(warm: Samples, models: Models | None, policies: list[SchedulePolicy],
            group: dist.ProcessGroup | None) -> AutoDecision:
    """AUTO's choice (``schedule.auto.decide``) from forecasts of every candidate:
    runtime schedules on the runtime's model plus their measured setup; the baseline
    (the serial schedule) and the kernel-by-kernel path (its whole-phase tasks, one
    worker per unit) on the baseline's model plus the measured count exchange; the
    warm-up times (median of the later iterations) may veto a taskflow."""
    def settled(name: str) -> float:
        later = warm.seconds[name][len(warm.seconds[name]) // 2:]
        return float(np.median(slowest_rank(np.array(later), group)))

    measured = {Candidate(Path.TASKFLOW, p).name: settled(runtime_name(p)) for p in policies}
    measured |= {BASELINE.name: settled(Variant.SERIAL.value),
                 KERNEL_BY_KERNEL.name: settled(Variant.KERNEL_BY_KERNEL.value)}
    if models is None:
        return dataclasses.replace(no_model(), measured_s=measured)
    steps = {p: warm.step_medians(runtime_name(p), group) for p in policies}
    exchange = min(st["exchange"] for st in steps.values())
    forecasts = [Forecast(Candidate(Path.TASKFLOW, p), forecast_region(warm.last[runtime_name(p)].schedule,
                                                                       models.runtime)[0],
                          st["exchange"] + st["schedule"] + st["prepare"]) for p, st in steps.items()]
    last = warm.last[Variant.SERIAL_SAME_TRANSPORT.value]
    serial, plan = last.schedule, last.plan
    forecasts += [kernel_by_kernel_forecast(plan, models.baseline, setup_s=exchange),
                  Forecast(BASELINE, forecast_region(serial, models.baseline)[0], exchange)]
    return decide(forecasts, measured)


def build_report(config: BenchConfig, policy: SchedulePolicy, s: Samples, models: Models | None,
                 decision: AutoDecision | None, group: dist.ProcessGroup | None, note: str,
                 probe: ShareProbe | None = None, steal: float | None = None,
                 tuned: Tuned | None = None, paired: dict[str, Stats] | None = None) -> BenchReport:
    """Reduce every rank's samples into the report (collective).  The prediction is made
    twice: with the share ``probe`` measured between the timed iterations, and with the
    share measured before them (the models AUTO decided with).  ``steal``: the host's
    steal over the timed iterations (``BenchReport.steal``)."""
    names = [v.value for v in Variant if v.value in s.seconds]
    sst, rt = Variant.SERIAL_SAME_TRANSPORT.value, Variant.RUNTIME.value
    stats = {n: Stats.of(slowest_rank(np.array(s.seconds[n]), group)) for n in names}
    sweep = {n.removeprefix("sweep:"): Stats.of(slowest_rank(np.array(s.seconds[n]), group))
             for n in s.seconds if n.startswith("sweep:")}
    steps = {n: s.step_medians(n, group) for n in (sst, rt)}
    prediction, predicted = None, None
    if probe is not None:  # made only with --predict and models
        during = models.at_share(probe.share(s.probe, group), group)
        entries = (s.entry_offsets(sst, group), s.entry_offsets(rt, group))
        kernels = s.kernel_cpu(rt, s.last[rt].schedule.graph.num_tasks, group)
        prediction, predicted = predict(s.last[sst], s.last[rt], steps[sst]["region"], steps[rt]["region"],
                                        during, models, entries, kernels)
    out, serial = s.outs, s.outs[Variant.SERIAL.value]
    unbalanced = out.get(Variant.UNBALANCED.value)
    return BenchReport(
        ep=dist.get_world_size(group), policy=policy, stats=stats, steps=steps,
        max_abs_diff=max_abs_diff(out[Variant.TASKFLOW.value], serial, group),
        unbalanced_max_abs_diff=None if unbalanced is None else max_abs_diff(unbalanced, serial, group),
        runtime_max_abs_diff=max_abs_diff(out[rt], serial, group),
        bitwise_equal=all_equal(out[rt], out[sst], group),
        candidate=s.last[rt].schedule.candidate or None, link=models.link if models else None,
        a2a=models.a2a if models else None, host=models.host if models else None,
        decision=decision, prediction=prediction, timeline=measured_timeline(s.last[rt], group),
        predicted_timeline=predicted, note=note, steal=steal,
        tuning=tuned.to_json() if tuned is not None else {}, sweep=sweep, paired=paired or {})

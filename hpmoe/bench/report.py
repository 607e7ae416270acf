"""What ``hpmoe bench`` reports: per-variant statistics, step breakdowns, the cost
model's decision and predictions, output differences, and the measured timeline
in the simulator's ``Timeline`` type."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ..ir.schedule import SchedulePolicy
from ..runtime.forward import ForwardOutput
from ..schedule.auto import AutoDecision
from ..sim.forecast import HostCosts, forecast_region, replay_on_kernels
from ..sim.simulate import SimResult, Timeline
from .forecast import Models, slowest_rank


@dataclass(frozen=True)
class Stats:
    """Milliseconds over iterations: median, quartiles, minimum."""

    median_ms: float
    p25_ms: float
    p75_ms: float
    min_ms: float

    @staticmethod
    def of(seconds: np.ndarray) -> Stats:
        q = np.percentile(seconds, [50, 25, 75]) * 1e3
        return Stats(float(q[0]), float(q[1]), float(q[2]), float(seconds.min() * 1e3))

    def fields(self, name: str) -> dict[str, float]:
        return {f"{name}_ms": round(self.median_ms, 3), f"{name}_p25_ms": round(self.p25_ms, 3),
                f"{name}_p75_ms": round(self.p75_ms, 3), f"{name}_min_ms": round(self.min_ms, 3)}


@dataclass(frozen=True)
class Prediction:
    """Simulated region makespans (ms) of the schedules that ran, next to the
    measured region times (ms, median of the slowest rank).  ``share``: the
    ``ShareProbe`` share measured between the timed iterations, which the forecasts
    use; ``taskflow_pre_ms``: the taskflow's forecast with the share measured before
    them instead (what AUTO decided with).  Every forecast is the median over the
    iterations of a replay in which each rank enters the region when it did in that
    iteration (``entry_skew_ms``: the median of the last rank's delay).
    ``taskflow_kernels_ms``: not a forecast but a check of the model around the
    kernels, the same replays on each iteration's own measured kernel CPU times
    (``sim.forecast.replay_on_kernels``)."""

    serial_schedule_ms: float
    taskflow_ms: float
    measured_serial_schedule_ms: float
    measured_taskflow_ms: float
    share: float
    taskflow_pre_ms: float
    entry_skew_ms: float
    taskflow_kernels_ms: float | None

    @property
    def errors(self) -> tuple[float, float]:
        """Relative errors (predicted / measured - 1) of both."""
        return (self.serial_schedule_ms / self.measured_serial_schedule_ms - 1.0,
                self.taskflow_ms / self.measured_taskflow_ms - 1.0)

    def fields(self) -> dict[str, float]:
        e, pre = self.errors, self.taskflow_pre_ms / self.measured_taskflow_ms - 1.0
        return {"predicted_serial_schedule_ms": round(self.serial_schedule_ms, 3),
                "predicted_taskflow_ms": round(self.taskflow_ms, 3),
                "measured_serial_schedule_region_ms": round(self.measured_serial_schedule_ms, 3),
                "measured_taskflow_region_ms": round(self.measured_taskflow_ms, 3),
                "prediction_error_serial_schedule": round(e[0], 4),
                "prediction_error_taskflow": round(e[1], 4),
                "cpu_share_during": round(self.share, 3),
                "predicted_taskflow_pre_ms": round(self.taskflow_pre_ms, 3),
                "prediction_error_taskflow_pre": round(pre, 4),
                "region_entry_skew_ms": round(self.entry_skew_ms, 3)} | self._kernel_fields()

    def _kernel_fields(self) -> dict[str, float]:
        if self.taskflow_kernels_ms is None:
            return {}
        return {"replayed_taskflow_on_measured_kernels_ms": round(self.taskflow_kernels_ms, 3),
                "replay_error_taskflow_on_measured_kernels":
                    round(self.taskflow_kernels_ms / self.measured_taskflow_ms - 1.0, 4)}


def predict(serial: ForwardOutput, flow: ForwardOutput, measured_serial_s: float, measured_flow_s: float,
            models: Models, before: Models, entries: tuple[np.ndarray, np.ndarray],
            kernels: np.ndarray) -> tuple[Prediction, Timeline]:
    """Forecast both runtime regions on the runtime's model of ``models``
    (``forecast_region``), and the taskflow's also on ``before``'s, each the median
    over iterations of a replay with that iteration's ``entries`` (serial's, flow's:
    [iterations, ranks] seconds each rank entered the region after the first); and
    replay the taskflow on each iteration's ``kernels`` ([iterations, tasks] kernel CPU
    seconds; not when NaN, i.e. not recorded); (prediction, the taskflow's simulated
    timeline of the last iteration)."""
    s = _median_forecast(serial, models, entries[0])[0]
    f, sim = _median_forecast(flow, models, entries[1])
    pre = _median_forecast(flow, before, entries[1])[0]
    on_kernels = None if np.isnan(kernels).any() else float(np.median(
        [replay_on_kernels(flow.schedule, models.runtime, cpu, models.host.executor_overhead, row)
         for cpu, row in zip(kernels, entries[1], strict=True)])) * 1e3
    return Prediction(serial_schedule_ms=s * 1e3, taskflow_ms=f * 1e3,
                      measured_serial_schedule_ms=measured_serial_s * 1e3,
                      measured_taskflow_ms=measured_flow_s * 1e3, share=models.share,
                      taskflow_pre_ms=pre * 1e3,
                      entry_skew_ms=float(np.median(entries[1].max(axis=1))) * 1e3,
                      taskflow_kernels_ms=on_kernels), sim.timeline


def _median_forecast(out: ForwardOutput, models: Models, entries: np.ndarray) -> tuple[float, SimResult]:
    """Median over ``entries``' rows of ``forecast_region`` with that row as each rank's
    entry; the last row's replay."""
    runs = [forecast_region(out.schedule, models.runtime, entry=row) for row in entries]
    return float(np.median([seconds for seconds, _ in runs])), runs[-1][1]


def measured_timeline(out: ForwardOutput, group: dist.ProcessGroup | None) -> Timeline:
    """Every rank's measured tasks of ``out``'s region as one ``Timeline`` (times from
    the earliest start; ranks of one host share the monotonic clock).  Collective."""
    tl = out.timeline
    mine = (out.program.task_ids[tl.task], tl.origin_ns / 1e9 + tl.start, tl.origin_ns / 1e9 + tl.end)
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    sched, g = out.schedule, out.schedule.graph
    start, end = np.full(g.num_tasks, np.nan), np.full(g.num_tasks, np.nan)
    for ids, s, e in parts:
        start[ids], end[ids] = s, e
    origin = np.nanmin(start) if g.num_tasks else 0.0
    nan = np.full(g.num_tasks, np.nan)
    return Timeline(ep=g.ep, workers=sched.workers, kind=g.kind, rank=g.rank, peer=g.peer, unit=g.unit,
                    worker=sched.worker, start=start - origin, end=end - origin, link_start=nan,
                    link_end=nan.copy())


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    """Largest |a - b| over every rank's outputs."""
    local = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    return float(slowest_rank(np.array([local]), group)[0])


def all_equal(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """``torch.equal`` on every rank."""
    return bool(slowest_rank(np.array([0.0 if torch.equal(a, b) else 1.0]), group)[0] == 0.0)


@dataclass(frozen=True)
class BenchReport:
    """Everything ``hpmoe bench`` prints (identical on every rank).  ``stats`` and
    ``steps`` are keyed by variant name (``bench.Variant`` values)."""

    ep: int
    policy: SchedulePolicy
    stats: dict[str, Stats]
    steps: dict[str, dict[str, float]]
    max_abs_diff: float
    runtime_max_abs_diff: float
    bitwise_equal: bool
    candidate: str | None
    link: tuple[float, float] | None
    a2a: tuple[float, float] | None
    host: HostCosts | None
    decision: AutoDecision | None
    prediction: Prediction | None
    timeline: Timeline
    predicted_timeline: Timeline | None
    note: str = ""
    steal: float | None = None  # share of the host's CPU time its hypervisor took over the timed iterations
    tuning: dict = field(default_factory=dict)  # AUTO's tuning (``bench.runner.Tuned.to_json``)
    sweep: dict[str, Stats] = field(default_factory=dict)  # every candidate of the tuning space, by name
    paired: dict[str, Stats] = field(default_factory=dict)  # ``bench.runner.head_to_head``'s two variants
    unbalanced_max_abs_diff: float | None = None  # under --balance: |layer without the placement - baseline|

    def to_json(self) -> dict:
        """Flat JSON-ready dict (milliseconds, ratios)."""
        st = {name: s.median_ms for name, s in self.stats.items()}
        out: dict = {"ep": self.ep, "schedule": self.policy.value, "candidate": self.candidate}
        for name, s in self.stats.items():
            out |= s.fields(name)
        out |= {"speedup": round(st["serial"] / st["taskflow"], 3),
                "kernel_by_kernel_speedup": round(st["serial"] / st["kernel_by_kernel"], 3),
                "runtime_speedup": round(st["serial"] / st["runtime_taskflow"], 3),
                "runtime_speedup_over_serial_schedule": round(
                    st["serial_same_transport"] / st["runtime_taskflow"], 3),
                "max_abs_diff": self.max_abs_diff, "runtime_max_abs_diff": self.runtime_max_abs_diff,
                "bitwise_equal_serial_schedule": self.bitwise_equal}
        for name, parts in self.steps.items():
            out |= {f"{name}_{k}_ms": round(s * 1e3, 3) for k, s in parts.items()}
        return out | self._extras()

    def _extras(self) -> dict:
        out: dict = {}
        if self.decision is not None:
            out |= self.decision.to_json() | {"auto": self.decision.describe()}
        if self.host is not None:
            out |= {"cpu_share": round(self.host.share, 3),
                    "executor_us_per_task": round(self.host.executor_overhead * 1e6, 2),
                    "vector_slowdown": round(self.host.vector_slowdown, 3),
                    "wake_latency_us": round(self.host.wake_latency * 1e6, 2),
                    "host_memory_gbytes_per_s": round(self.host.host_mem_bw / 1e9, 3),
                    "launch_us": round(self.host.launch_overhead * 1e6, 1)}
            if self.host.put_cpu:
                out["put_cpu_us"] = round(self.host.put_cpu * 1e6, 2)
        if self.link is not None:
            out |= {"link_measured_gbytes_per_s": round(self.link[0] / 1e9, 4),
                    "link_latency_us": round(self.link[1] * 1e6, 1)}
        if self.a2a is not None:  # its startup is inside the effective rate: no latency of its own
            out["all_to_all_measured_gbytes_per_s"] = round(self.a2a[0] / 1e9, 4)
        if self.prediction is not None:
            out |= self.prediction.fields()
        if self.steal is not None:
            out["host_steal_fraction"] = round(self.steal, 4)
        if "unbalanced" in self.stats:
            plain, placed = self.stats["unbalanced"], self.stats["taskflow"]
            out |= {"balance_gain": round(plain.median_ms / placed.median_ms, 3),
                    "balance_gain_fastest": round(plain.min_ms / placed.min_ms, 3),
                    "unbalanced_max_abs_diff": self.unbalanced_max_abs_diff}
        sweep = sweep_fields(self.sweep, self.stats["taskflow"], self.tuning.get("tune_winner"))
        note = {"note": self.note} if self.note else {}
        return out | self.tuning | sweep | paired_fields(self.paired) | note


def paired_fields(paired: dict[str, Stats]) -> dict:
    """The head-to-head's fields: the candidate, both variants' median and fastest, and
    the default's ratios to it (candidate / default: above 1, the default is faster)."""
    if not paired:
        return {}
    default, (name, best) = paired["taskflow"], next((n, s) for n, s in paired.items() if n != "taskflow")
    return {"paired_candidate": name.removeprefix("sweep:"),
            "paired_default_ms": round(default.median_ms, 3),
            "paired_default_min_ms": round(default.min_ms, 3),
            "paired_candidate_ms": round(best.median_ms, 3),
            "paired_candidate_min_ms": round(best.min_ms, 3),
            "default_over_paired": round(best.median_ms / default.median_ms, 3),
            "default_over_paired_fastest": round(best.min_ms / default.min_ms, 3)}


def sweep_fields(sweep: dict[str, Stats], default: Stats, winner: str | None) -> dict:
    """The exhaustive sweep's fields: each candidate's median and fastest, the best by
    median, and the default's ratio to it (best / default: above 1, the default is
    faster); with a tuned ``winner`` in the sweep, the same ratio for its own samples
    there (the choice alone, timed like every candidate)."""
    if not sweep:
        return {}
    best = min(sweep, key=lambda n: sweep[n].median_ms)
    fastest = min(s.min_ms for s in sweep.values())
    out = {"sweep": {n: {"ms": round(s.median_ms, 3), "min_ms": round(s.min_ms, 3)}
                     for n, s in sweep.items()},
           "sweep_best": best, "sweep_best_ms": round(sweep[best].median_ms, 3)}
    for name, stats in {"default": default, "chosen": sweep.get(winner)}.items():
        if stats is not None:
            out |= {f"{name}_over_sweep_best": round(sweep[best].median_ms / stats.median_ms, 3),
                    f"{name}_over_sweep_best_fastest": round(fastest / stats.min_ms, 3)}
    return out

"""A GPU hardware model fitted to a measured timeline of the persistent kernel.

From the per-task stamps of one region (``DeviceProgram.timeline``):

1. durations: least squares of ``end - start`` over every task as
   ``overhead + padded GEMM FLOP / matrix rate`` (matrix tasks: the rate holds their
   memory stalls, so the model charges them no bytes), ``overhead + bytes / copy
   bandwidth`` (vector tasks, the puts included: on one GPU a put is a device copy) and
   ``overhead + bytes / unpermute bandwidth`` (the unpermute gathers k rows per token,
   slower per byte than a copy: the model's ``unpermute_traffic`` is their ratio) — one
   overhead, one rate, two bandwidths per worker;
2. signal-to-start latency: for every task that had to wait (its event's last signal
   came after its worker was free), the median gap from that signal to its start.

``calibrated_hardware`` writes them into a ``HardwareModel`` with the run's worker counts,
so the simulator can predict the same configuration and be compared with the measurement.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from .core import HardwareModel, LinkEntry, Schedule, TaskGraph, TaskKind, Timeline, Unit, gemm_dims


@dataclass(frozen=True)
class GpuCalibration:
    """Fitted per-worker figures of one measured run (seconds, FLOP/s, bytes/s) and the
    fit's relative root-mean-square residual over task durations."""

    task_overhead: float
    matrix_flops: float
    copy_bandwidth: float
    unpermute_traffic: float
    signal_latency: float
    residual: float
    tasks: int


def padded_flops(graph: TaskGraph, block: int) -> np.ndarray:
    """[n] GEMM FLOP of every task with m, n, k padded to ``block`` (0 for vector tasks)."""
    m, n, k = gemm_dims(graph)
    pm, pn, pk = (np.ceil(x / block) * block for x in (m, n, k))
    return np.where(graph.unit == Unit.MATRIX, 2.0 * pm * pn * pk, 0.0)


def fit_durations(graph: TaskGraph, timeline: Timeline,
                  block: int) -> tuple[float, float, float, float, float]:
    """(overhead s, matrix FLOP/s, copy bytes/s, unpermute traffic, relative rms residual)
    by least squares (traffic 1 when the graph has no unpermute)."""
    d = timeline.end - timeline.start
    vector = graph.unit == Unit.VECTOR
    unpermute = graph.kind == TaskKind.UNPERMUTE
    copy = np.where(vector & ~unpermute, graph.bytes, 0.0)
    cols = [np.ones(graph.num_tasks), padded_flops(graph, block), copy]
    if unpermute.any():
        cols.append(np.where(unpermute, graph.bytes, 0.0))
    a = np.stack(cols, axis=1)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    coef, *_ = np.linalg.lstsq(a / scale, d, rcond=None)
    coef = coef / scale
    if (coef[1:] <= 0).any():
        raise ValueError(f"the timeline does not determine a rate (fit {coef.tolist()}): it needs matrix "
                         "tasks of different sizes and vector tasks moving different byte counts")
    residual = float(np.sqrt(np.mean((a @ coef - d) ** 2)) / max(float(d.mean()), 1e-30))
    traffic = float(coef[3] / coef[2]) if unpermute.any() else 1.0
    return max(float(coef[0]), 0.0), 1.0 / float(coef[1]), 1.0 / float(coef[2]), traffic, residual


def signal_latency(schedule: Schedule, timeline: Timeline) -> float:
    """Median seconds from the signal that released a task to its start, over the tasks
    whose worker was free before that signal (0 when no task waited)."""
    g = schedule.graph
    ready = np.full(g.num_events, -np.inf)
    np.maximum.at(ready, g.signals_global(), timeline.end[g.signaller()])
    wait = g.wait_global()
    free = np.full(g.num_tasks, -np.inf)
    for q in range(schedule.num_queues):
        tasks = schedule.queue_task[schedule.queue_ptr[q]:schedule.queue_ptr[q + 1]]
        free[tasks[1:]] = timeline.end[tasks[:-1]]
    released = np.where(wait >= 0, ready[np.maximum(wait, 0)], -np.inf)
    waited = (wait >= 0) & (released > free)
    gaps = timeline.start[waited] - released[waited]
    return float(np.median(gaps)) if len(gaps) else 0.0


def calibrate(schedule: Schedule, timeline: Timeline, block: int = 16) -> GpuCalibration:
    """Fit ``GpuCalibration`` to a measured ``timeline`` of ``schedule``."""
    if timeline.num_tasks != schedule.graph.num_tasks:
        raise ValueError(f"timeline has {timeline.num_tasks} tasks, the schedule {schedule.graph.num_tasks}")
    overhead, rate, bw, traffic, residual = fit_durations(schedule.graph, timeline, block)
    return GpuCalibration(task_overhead=overhead, matrix_flops=rate, copy_bandwidth=bw,
                          unpermute_traffic=traffic, signal_latency=signal_latency(schedule, timeline),
                          residual=residual, tasks=timeline.num_tasks)


def calibrated_hardware(base: HardwareModel, cal: GpuCalibration, schedule: Schedule,
                        dtype: torch.dtype) -> HardwareModel:
    """``base`` with the fitted figures and the run's workers: per-worker matrix rate (of
    ``dtype``, no memory bound on matrix tasks), memory bandwidth = copy bandwidth x vector
    workers (the cost model gives each worker its share), the unpermute's traffic, puts at
    the same rate, the signal latency as put latency."""
    w = schedule.workers
    mem = cal.copy_bandwidth * w.vector
    rates = {"matrix_flops_bf16" if dtype == torch.bfloat16 else "matrix_flops_fp32": cal.matrix_flops}
    link = tuple(LinkEntry(ep, mem, mem) for ep in (1, 2, 4, 8))
    return dataclasses.replace(base, name=f"{base.name}-calibrated", matrix_workers=w.matrix,
                               vector_workers=w.vector, mem_bw=mem, task_overhead=cal.task_overhead,
                               link_latency=cal.signal_latency, link=link, matrix_block=16,
                               vector_flops=max(base.vector_flops, 1e15),
                               # the fit is per worker: the simulator's per-worker roofline
                               shared_hbm=False, matrix_memory=False, unpermute_traffic=cal.unpermute_traffic,
                               matrix_efficiency=1.0, matrix_full_edge=1,
                               stream_bw=0.0, l2_mb=0.0,
                               notes=f"fitted to {cal.tasks} measured tasks (rms residual "
                                     f"{cal.residual:.1%})",
                               **rates)

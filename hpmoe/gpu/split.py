"""How the resident programs of a GPU region are split between matrix and vector
workers: chosen by measuring, once per region shape and process.

The cost model's split (``residency.split_workers``) gives a vector worker its share of
the whole memory bandwidth; one program of the persistent kernel streams far less (an
H200 measured the cost model's 127 + 5 split of DeepSeek-V3's forward at 39.5 ms, 99 +
33 at 12.3 ms: docs/lab).  So the region is scheduled with the model's split and with
``SHARES`` of the programs as matrix workers, each schedule is run on the region's own
arena (a warm-up and ``REPEATS`` timed runs, CUDA events, median), and the fastest is
kept; a run with a late wait counts as infinitely slow.  The chosen share is reused for
regions of the same key (policy, dtype, kernel config, workers per rank, task kinds, and
the region's FLOPs and bytes to a quarter of a power of two): routing that moves rows
between experts from step to step keeps the choice."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable

import numpy as np
import torch

from .buffers import Arena
from .core import HardwareModel, Schedule, SchedulePolicy, TaskGraph, WorkerCounts, schedule
from .pack import pack
from .residency import split_workers
from .runner import DeviceProgram, KernelConfig

SHARES = (0.5, 0.6, 0.7, 0.8)
REPEATS = 3
_CHOSEN: dict[tuple, float] = {}


def split_key(graph: TaskGraph, policy: SchedulePolicy, dtype: torch.dtype, config: KernelConfig | None,
              per_rank: int) -> tuple:
    """What a measured share is kept for."""
    def bucket(x: float) -> int:
        return round(4 * math.log2(max(x, 1.0)))
    return (policy, dtype, config, per_rank, graph.ep, tuple(np.unique(graph.kind).tolist()),
            bucket(float(graph.flops.sum())), bucket(float(graph.bytes.sum())))


def candidates(graph: TaskGraph, hardware: HardwareModel, per_rank: int) -> list[WorkerCounts]:
    """The cost model's split and ``SHARES`` of ``per_rank`` as matrix workers, each unit
    at least one worker, without repeats."""
    out = [split_workers(graph, hardware, per_rank)]
    for share in SHARES:
        m = int(np.clip(round(per_rank * share), 1, per_rank - 1))
        out.append(WorkerCounts(matrix=m, vector=per_rank - m))
    return list(dict.fromkeys(out))


def scheduled(graph: TaskGraph, policy: SchedulePolicy, hardware: HardwareModel,
              workers: WorkerCounts) -> Schedule:
    hw = dataclasses.replace(hardware, matrix_workers=workers.matrix, vector_workers=workers.vector)
    return schedule(graph, policy, hw)


def measured_schedule(graph: TaskGraph, policy: SchedulePolicy, hardware: HardwareModel, key: tuple,
                      per_rank: int, timer: Callable[[Schedule], float]) -> Schedule:
    """The schedule of the fastest split of ``per_rank`` workers, ``timer`` giving each
    candidate's milliseconds (``run_ms`` on the region's arena); the share chosen for
    ``key`` (``split_key``) is reused without measuring."""
    if key in _CHOSEN:
        m = int(np.clip(round(per_rank * _CHOSEN[key]), 1, per_rank - 1))
        return scheduled(graph, policy, hardware, WorkerCounts(matrix=m, vector=per_rank - m))
    timed = []
    for workers in candidates(graph, hardware, per_rank):
        sched = scheduled(graph, policy, hardware, workers)
        timed.append((timer(sched), workers.matrix, sched))
    _, matrix, best = min(timed, key=lambda t: (t[0], t[1]))
    _CHOSEN[key] = matrix / per_rank
    return best


def run_ms(sched: Schedule, arena: Arena, config: KernelConfig | None, deadline_s: float) -> float:
    """Median milliseconds of ``REPEATS`` runs of ``sched`` on ``arena`` after a warm-up;
    infinity when a wait passed its deadline."""
    program = DeviceProgram(pack(sched, arena.space), arena.device, arena.dtype, config)
    go = program.launcher(arena.addresses(), deadline_s)
    ms = cuda_ms(go, REPEATS, 1)
    return math.inf if int(go.errors[:, 0].sum()) else ms


def cuda_ms(fn: Callable[[], object], reps: int, warmup: int) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` after ``warmup`` ones, each timed
    with CUDA events around it."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)

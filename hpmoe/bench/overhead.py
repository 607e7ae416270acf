"""The executor's own cost per task, measured on empty tasks in this process.

Three shapes of graph, each N empty tasks of one rank:
  independent: one worker, no waits (loop, call, timeline record);
  chain:       task i waits on the event task i-1 signals, same worker
               (a counter read and a futex add per task);
  ping-pong:   the chain alternates between a matrix and a vector worker, so every
               task waits for the other thread (futex sleep and wake per task).

And the executor's CPU per task under load (``loaded_cost``): the matrix worker runs
GEMM tiles back to back, the vector worker a small elementwise tile after each, so both
threads are busy and the vector one sleeps and wakes per tile, as in a region; the
process's CPU time outside the kernels, per task, how much slower the vector kernel
runs there than alone (the matrix thread's streaming evicts its operands), and the
region's wall time outside its workers (before the first starts, after the last task).
"""

from __future__ import annotations

import enum
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..exec.program import compile_program
from ..ir.graph import GraphBuilder, TaskBlock, TaskGraph, TaskKind
from ..ir.schedule import SchedulePolicy, WorkerCounts, schedule_from_assignment
from ..regions.base import Region
from ..regions.kernels import glu
from ..runtime.executor import Executor, ExecutorConfig, RegionResult
from ..runtime.transport.local import LocalTransport
from ..sim.calibrate import torch_threads
from ..spec import Activation


class EmptyShape(enum.Enum):
    INDEPENDENT = "independent"
    CHAIN = "chain"
    PING_PONG = "ping-pong"


def _noop(*args: object) -> None:
    return None


EMPTY = Region(kind=None, lower=lambda *a: empty_graph(1, EmptyShape.INDEPENDENT)[0],
               kernels={TaskKind.GEMM_UP: _noop, TaskKind.SWIGLU: _noop}, puts={}, buffers=object,
               symmetric_shapes=lambda *a: {})


def _tasks(kind: TaskKind, wait: np.ndarray, signal: np.ndarray) -> TaskBlock:
    """Empty tasks of rank 0: task j waits on event ``wait[j]`` and signals event
    ``signal[j]`` (-1: none)."""
    zero, sig = np.zeros(len(wait), np.int64), signal[signal >= 0]
    return TaskBlock(kind=kind, rank=zero.astype(np.int32), peer=zero.astype(np.int32), expert=zero - 1,
                     row0=zero, row1=zero, col0=zero, col1=zero, dst_row0=zero, flops=zero, bytes=zero,
                     link_bytes=zero, wait=wait, sig_count=(signal >= 0).astype(np.int64),
                     sig_rank=np.zeros(len(sig), np.int32), sig_event=sig)


def empty_graph(n: int, shape: EmptyShape) -> tuple[TaskGraph, np.ndarray]:
    """(graph of ``n`` empty tasks, each task's position in the chain)."""
    chained = shape is not EmptyShape.INDEPENDENT
    ids = np.arange(n)
    kinds = (TaskKind.GEMM_UP, TaskKind.SWIGLU) if shape is EmptyShape.PING_PONG else (TaskKind.GEMM_UP,)
    b = GraphBuilder(1, (0,))
    parts = [ids[ids % len(kinds) == j] for j in range(len(kinds))]
    for kind, part in zip(kinds, parts, strict=True):  # task i waits on event i - 1, signals event i
        b.add(_tasks(kind, np.where(chained & (part > 0), part - 1, -1),
                     np.where(chained & (part < n - 1), part, -1)))
    b.set_events(0, np.ones(n - 1 if chained else 0, np.int64))
    return b.freeze(), np.concatenate(parts)


def _repeat(graph: TaskGraph, region: Region, position: np.ndarray, repeats: int,
            measure: Callable[[Callable[[], RegionResult]], object], thread_cpu: bool = False) -> list:
    """``measure(run)`` of the one-rank ``graph`` scheduled on one worker per unit in
    ``position`` order, ``repeats`` times after one warm-up run (which is dropped), on an
    executor recording its tasks' thread CPU or not (``ExecutorConfig.thread_cpu``)."""
    sched = schedule_from_assignment(graph, SchedulePolicy.HYPERPARALLEL, WorkerCounts(1, 1),
                                     np.zeros(graph.num_tasks, np.int64), position)
    program = compile_program(sched, region, 0)
    transport, executor = LocalTransport(), Executor(ExecutorConfig(deadline_s=30.0, thread_cpu=thread_cpu))
    samples = []
    try:
        for _ in range(repeats + 1):
            transport.begin()
            transport.prepare_events(program.num_events)
            samples.append(measure(lambda: executor.run(program, region, None, None, transport)))
    finally:
        executor.close()
    return samples[1:]


def _wall(run: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def seconds_per_task(n: int, shape: EmptyShape, repeats: int = 5) -> float:
    """Median over ``repeats`` of the region's wall time / ``n`` (seconds)."""
    graph, position = empty_graph(n, shape)
    return statistics.median(_repeat(graph, EMPTY, position, repeats, _wall)) / n


def wake_latency(n: int = 1000, repeats: int = 3) -> float:
    """Seconds a hand-off between a rank's two workers adds to a task: an empty
    ping-pong's wall time per task (every task wakes the other thread) less an empty
    chain's on one worker (the same waits and signals, never asleep), at least 0."""
    ping_pong = seconds_per_task(n, EmptyShape.PING_PONG, repeats)
    return max(0.0, ping_pong - seconds_per_task(n, EmptyShape.CHAIN, repeats))


def loaded_graph(n: int) -> TaskGraph:
    """``n`` GEMM_UP tasks, each signalling its own event, and ``n`` SWIGLU tasks, task i
    waiting for GEMM i's event (one rank)."""
    ids, none = np.arange(n), np.full(n, -1)
    b = GraphBuilder(1, (0,))
    b.add(_tasks(TaskKind.GEMM_UP, none, ids))
    b.add(_tasks(TaskKind.SWIGLU, ids, none))
    b.set_events(0, np.ones(n, np.int64))
    return b.freeze()


def process_cpu() -> float:
    """CPU seconds of this process so far: every thread, user and kernel."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def cpu_ticks(stat_line: str) -> tuple[int, int]:
    """(steal, total) clock ticks of ``/proc/stat``'s ``cpu`` line: total is user, nice,
    system, idle, iowait, irq, softirq and steal (guest time is inside user and nice)."""
    fields = [int(x) for x in stat_line.split()[1:9]]
    if len(fields) < 8:
        raise ValueError(f"/proc/stat cpu line has {len(fields)} of 8 fields: {stat_line!r}")
    return fields[7], sum(fields)


def host_ticks() -> tuple[int, int] | None:
    """``cpu_ticks`` of every CPU of this host so far; None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            return cpu_ticks(f.readline())
    except OSError:
        return None


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Share of the host's CPU time between two ``host_ticks`` that its hypervisor gave
    to others (steal); None when either reading is missing or no time passed."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def tile_kernels() -> tuple[Callable[[], object], Callable[[], object]]:
    """(GEMM, SwiGLU) kernels of the loaded graph: a 128 x 512 x 512 bf16 GEMM tile and a
    64 x 768 SwiGLU tile, on buffers of their own."""
    g = torch.Generator().manual_seed(0)
    a, w = (torch.randn(r, 512, generator=g, device="cpu").to(torch.bfloat16) for r in (128, 512))
    h = torch.randn(64, 1536, generator=g, device="cpu").to(torch.bfloat16)
    out = torch.empty(128, 512, dtype=torch.bfloat16, device="cpu")
    act = torch.empty(64, 768, dtype=torch.bfloat16, device="cpu")
    return (lambda: torch.mm(a, w.t(), out=out)), (lambda: glu(h, act, Activation.SILU))


@dataclass(frozen=True)
class LoadedCost:
    """What a region's two busy workers cost a rank, from ``loaded_cost``.

    outside_s: the process's CPU seconds per task outside the kernels (the executor's
    own cost), the launch's excluded.  vector_slowdown: the vector kernel's CPU per call
    while the matrix worker runs beside it, over the same kernel's CPU per call alone
    just before.  launch_s: seconds of ``Executor.run`` outside its workers: before they
    start (building the tasks' calls) and after the last task ends (finish, settle, the
    timeline)."""

    outside_s: float
    vector_slowdown: float
    launch_s: float


def loaded_cost(n: int = 300, repeats: int = 3,
                kernels: tuple[Callable[[], object], Callable[[], object]] | None = None,
                alone_s: float = 0.1, thread_cpu: bool = False) -> LoadedCost:
    """Medians over ``repeats`` runs of ``loaded_graph(n)``, whose matrix tasks run
    ``kernels[0]`` and vector tasks ``kernels[1]`` (default ``tile_kernels()``; thread
    CPU time around every kernel), after the vector kernel has run alone for
    ``alone_s`` seconds, on an executor recording its tasks' thread CPU as the measured
    regions will (``thread_cpu``).  Run it on every rank at once, as a region runs."""
    gemm, vector = kernels or tile_kernels()
    spent = {TaskKind.GEMM_UP: 0.0, TaskKind.SWIGLU: 0.0}  # each kind runs on one worker thread

    def timed(kind: TaskKind, fn: Callable[[], object]) -> Callable[..., None]:
        def kernel(*args: object) -> None:
            t0 = time.thread_time()
            fn()
            spent[kind] += time.thread_time() - t0
        return kernel
    graph = loaded_graph(n)
    region = Region(kind=None, lower=lambda *x: graph, buffers=object, puts={},
                    kernels={TaskKind.GEMM_UP: timed(TaskKind.GEMM_UP, gemm),
                             TaskKind.SWIGLU: timed(TaskKind.SWIGLU, vector)},
                    symmetric_shapes=lambda *x: {})

    def measure(run: Callable[[], RegionResult]) -> tuple[float, float, float]:
        spent.update(dict.fromkeys(spent, 0.0))
        cpu, t0 = process_cpu(), time.perf_counter()
        result = run()
        wall, cpu = time.perf_counter() - t0, process_cpu() - cpu
        launch = max(0.0, wall - float(result.timeline.end.max(initial=0.0)))  # workers: origin to last end
        return (cpu - launch - sum(spent.values())) / (2 * n), spent[TaskKind.SWIGLU] / n, launch
    with torch_threads(1):  # the kernels' whole CPU is on the calling thread
        alone = per_call(vector, alone_s)[1]
        samples = _repeat(graph, region, np.concatenate([np.arange(n)] * 2), repeats, measure, thread_cpu)
    outside, loaded, launch = (statistics.median(column) for column in zip(*samples, strict=True))
    return LoadedCost(outside_s=max(0.0, outside), vector_slowdown=loaded / max(alone, 1e-12),
                      launch_s=launch)


def per_call(fn: Callable[[], object], seconds: float) -> tuple[float, float]:
    """(wall seconds, thread CPU seconds) per ``fn()`` call, calling it for ``seconds``
    of wall time (at least once)."""
    n, t0, c0 = 0, time.perf_counter(), time.thread_time()
    while n == 0 or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n, (time.thread_time() - c0) / n

"""The executor's own cost per task, measured on empty tasks in this process.

Three shapes of graph, each N empty tasks of one rank:
  independent: one worker, no waits (loop, call, timeline record);
  chain:       task i waits on the event task i-1 signals, same worker
               (a counter read and a futex add per task);
  ping-pong:   the chain alternates between a matrix and a vector worker, so every
               task waits for the other thread (futex sleep and wake per task).
"""

from __future__ import annotations

import enum
import statistics
import time

import numpy as np

from ..exec.program import compile_program
from ..ir.graph import GraphBuilder, TaskBlock, TaskGraph, TaskKind
from ..regions.base import Region
from ..runtime.executor import Executor, ExecutorConfig
from ..runtime.transport.local import LocalTransport
from ..schedule.base import SchedulePolicy, WorkerCounts, schedule_from_assignment


class EmptyShape(enum.Enum):
    INDEPENDENT = "independent"
    CHAIN = "chain"
    PING_PONG = "ping-pong"


def _noop(*args: object) -> None:
    return None


EMPTY = Region(kind=None, lower=lambda *a: empty_graph(1, EmptyShape.INDEPENDENT)[0],
               kernels={TaskKind.GEMM_UP: _noop, TaskKind.SWIGLU: _noop}, puts={}, buffers=object,
               symmetric_shapes=lambda *a: {})


def _block(kind: TaskKind, ids: np.ndarray, n: int, chained: bool) -> TaskBlock:
    """Tasks ``ids`` of the chain (task i signals event i, waits on event i - 1)."""
    zero = np.zeros(len(ids), np.int64)
    sig = ids[ids < n - 1] if chained else ids[:0]
    return TaskBlock(kind=kind, rank=zero.astype(np.int32), peer=zero.astype(np.int32), expert=zero - 1,
                     row0=zero, row1=zero, col0=zero, col1=zero, dst_row0=zero, flops=zero, bytes=zero,
                     link_bytes=zero, wait=np.where(chained & (ids > 0), ids - 1, -1),
                     sig_count=(ids < n - 1).astype(np.int64) if chained else zero,
                     sig_rank=np.zeros(len(sig), np.int32), sig_event=sig)


def empty_graph(n: int, shape: EmptyShape) -> tuple[TaskGraph, np.ndarray]:
    """(graph of ``n`` empty tasks, each task's position in the chain)."""
    chained = shape is not EmptyShape.INDEPENDENT
    ids = np.arange(n)
    kinds = (TaskKind.GEMM_UP, TaskKind.SWIGLU) if shape is EmptyShape.PING_PONG else (TaskKind.GEMM_UP,)
    b = GraphBuilder(1, (0,))
    parts = [ids[ids % len(kinds) == j] for j in range(len(kinds))]
    for kind, part in zip(kinds, parts, strict=True):
        b.add(_block(kind, part, n, chained))
    b.set_events(0, np.ones(n - 1 if chained else 0, np.int64))
    return b.freeze(), np.concatenate(parts)


def seconds_per_task(n: int, shape: EmptyShape, repeats: int = 5) -> float:
    """Median over ``repeats`` of the region's wall time / ``n`` (seconds)."""
    graph, position = empty_graph(n, shape)
    sched = schedule_from_assignment(graph, SchedulePolicy.HYPERPARALLEL, WorkerCounts(1, 1),
                                     np.zeros(n, np.int64), position)
    program = compile_program(sched, EMPTY, 0)
    transport, executor = LocalTransport(), Executor(ExecutorConfig(deadline_s=30.0))
    times = []
    try:
        for _ in range(repeats + 1):
            transport.begin()
            transport.prepare_events(program.num_events)
            t0 = time.perf_counter()
            executor.run(program, EMPTY, None, None, transport)
            times.append(time.perf_counter() - t0)
    finally:
        executor.close()
    return statistics.median(times[1:]) / n

"""The ``Schedule`` every scheduler returns and every executor/simulator reads.

A schedule places each task of a ``TaskGraph`` on one worker of its rank and unit
and fixes the order of each worker's queue.  Workers run their queue in order and
block only on event counters.  A schedule may carry a graph with extra
dependencies (the serial baseline adds phase barriers), so consumers must read
``schedule.graph``, never the graph they passed in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from .graph import TaskGraph, Unit


class SchedulePolicy(enum.Enum):
    SERIAL = "serial"  # kernel-by-kernel phases with barriers (the baseline)
    HYPERPARALLEL = "hyperparallel"  # the paper: round-robin in topological order
    CRITICAL_PATH = "critical-path"  # cost-model list scheduling (ours)
    AUTO = "auto"  # not a queue order: schedule.auto forecasts every way to run and picks one


QUEUE_POLICIES = (SchedulePolicy.SERIAL, SchedulePolicy.HYPERPARALLEL, SchedulePolicy.CRITICAL_PATH)


@dataclass(frozen=True)
class WorkerCounts:
    """Workers per rank for each unit."""

    matrix: int
    vector: int

    def __post_init__(self) -> None:
        for name in ("matrix", "vector"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"WorkerCounts.{name} must be a positive int, got {value!r}")

    def of(self, unit: Unit) -> int:
        return self.matrix if unit == Unit.MATRIX else self.vector

    @property
    def per_rank(self) -> int:
        return self.matrix + self.vector


@dataclass(frozen=True)
class Schedule:
    """Queues of every worker of every rank of ``graph``.

    worker: [n] int32 — worker index of each task within its (rank, unit).
    queue: [n] int64 — global queue id of each task:
        ``rank * workers.per_rank + (worker if MATRIX else workers.matrix + worker)``.
    queue_ptr / queue_task: CSR, the tasks of each queue in execution order
        (``queue_ptr`` has ``ep * workers.per_rank + 1`` entries).
    candidate: which of the policy's candidates this is (e.g. ``list-stages``);
    candidates: (name, simulated makespan in s) of every candidate the policy weighed.
    """

    graph: TaskGraph
    policy: SchedulePolicy
    workers: WorkerCounts
    worker: np.ndarray
    queue: np.ndarray
    queue_ptr: np.ndarray
    queue_task: np.ndarray
    candidate: str = ""
    candidates: tuple[tuple[str, float], ...] = ()

    @property
    def num_queues(self) -> int:
        return len(self.queue_ptr) - 1

    def queue_of(self, rank: int, unit: Unit, worker: int) -> np.ndarray:
        """Ordered task ids of one worker."""
        q = queue_id(self.workers, np.int64(rank), np.int8(unit), np.int64(worker))
        return self.queue_task[self.queue_ptr[q]:self.queue_ptr[q + 1]]

    def describe_queue(self, q: int) -> str:
        per = self.workers.per_rank
        rank, w = divmod(int(q), per)
        unit = Unit.MATRIX if w < self.workers.matrix else Unit.VECTOR
        idx = w if unit == Unit.MATRIX else w - self.workers.matrix
        return f"rank {rank} {unit.name.lower()} worker {idx}"


def queue_id(workers: WorkerCounts, rank: np.ndarray, unit: np.ndarray, worker: np.ndarray) -> np.ndarray:
    vector = np.asarray(unit) == Unit.VECTOR
    return rank.astype(np.int64) * workers.per_rank + np.where(vector, workers.matrix, 0) + worker


def schedule_from_assignment(graph: TaskGraph, policy: SchedulePolicy, workers: WorkerCounts,
                             worker: np.ndarray, priority: np.ndarray) -> Schedule:
    """Build a schedule from each task's worker and a sort key: within a queue,
    tasks run by increasing ``priority`` (ties by task id)."""
    worker = np.asarray(worker, np.int32)
    limit = np.where(graph.unit == Unit.MATRIX, workers.matrix, workers.vector)
    if graph.num_tasks and (worker.min() < 0 or (worker >= limit).any()):
        bad = int(np.flatnonzero((worker < 0) | (worker >= limit))[0])
        raise ValueError(f"worker[{bad}]={worker[bad]} outside the {limit[bad]} workers of its unit")
    queue = queue_id(workers, graph.rank, graph.unit, worker)
    order = np.lexsort((np.arange(graph.num_tasks), priority, queue))
    ptr = np.zeros(graph.ep * workers.per_rank + 1, np.int64)
    np.cumsum(np.bincount(queue, minlength=graph.ep * workers.per_rank), out=ptr[1:])
    return Schedule(graph=graph, policy=policy, workers=workers, worker=worker, queue=queue,
                    queue_ptr=ptr, queue_task=order.astype(np.int64))

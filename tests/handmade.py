"""Hand-built task graphs and round-number hardware for the cost, schedule, simulator and
trace tests, so that expected timelines can be written down exactly.

``UNIT_HW``: 1 matrix + 2 vector workers, 1 TFLOP/s matrix (block 1: no padding),
1 GFLOP/s vector, memory fast enough never to matter for the hand-built tasks, links
1 GB/s dispatch / 0.5 GB/s combine, 1 µs latency, no per-task overhead.  So a GEMM of
``flops`` takes flops / 1e12 s, a vector task flops / 1e9 s, a remote dispatch put of
``link_bytes`` takes link_bytes / 1e9 s on the link plus 1 µs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hpmoe.ir.graph import IS_PUT, GraphBuilder, TaskBlock, TaskGraph, TaskKind
from hpmoe.schedule import Schedule, SchedulePolicy, WorkerCounts, schedule_from_assignment
from hpmoe.sim.hardware import HardwareModel, LinkEntry

US = 1e-6

UNIT_HW = HardwareModel(
    name="unit", matrix_workers=1, vector_workers=2, matrix_flops_bf16=1e12, matrix_flops_fp32=1e12,
    matrix_block=1, vector_flops=1e9, mem_bw=1e18, link=(LinkEntry(1, 1e9, 5e8),), link_latency=1e-6,
    task_overhead=0.0)
UNIT_WORKERS = WorkerCounts(matrix=1, vector=2)


@dataclass
class Task:
    """One hand-written task; ``signals`` are (owner rank, local event) pairs."""

    kind: TaskKind
    rank: int = 0
    peer: int | None = None
    flops: float = 0.0
    bytes: float = 0.0
    link_bytes: float = 0.0
    wait: int = -1
    signals: list[tuple[int, int]] = field(default_factory=list)


def gemm(us: float, **kw) -> Task:
    """A GEMM_UP tile (1 x 1 x k) that takes ``us`` µs on UNIT_HW."""
    return Task(TaskKind.GEMM_UP, flops=us * 1e6, **kw)


def vec(us: float, kind: TaskKind = TaskKind.SWIGLU, **kw) -> Task:
    """A vector task that takes ``us`` µs on UNIT_HW."""
    return Task(kind, flops=us * 1e3, **kw)


def put(rank: int, peer: int, us: float, kind: TaskKind = TaskKind.DISPATCH, **kw) -> Task:
    """A put of ``us`` * 1000 bytes: ``us`` µs on UNIT_HW's dispatch link when ``peer`` is
    another rank; a local copy (no link bytes, as the lowering makes it) otherwise."""
    return Task(kind, rank=rank, peer=peer, link_bytes=us * 1e3 if peer != rank else 0.0,
                bytes=2 * us * 1e3, **kw)


def build(ep: int, tasks: list[Task], thresholds: dict[int, list[int]]) -> TaskGraph:
    """Freeze ``tasks`` (task id = list position) into a graph of ``ep`` ranks."""
    b = GraphBuilder(ep, tuple(range(ep)))
    for t in tasks:
        peer = t.rank if t.peer is None else t.peer
        one = np.array([t.rank])
        b.add(TaskBlock(kind=t.kind, rank=one, peer=np.array([peer]), expert=np.array([0]),
                        row0=np.array([0]), row1=np.array([1]), col0=np.array([0]), col1=np.array([1]),
                        dst_row0=np.array([0]), flops=np.array([t.flops]), bytes=np.array([t.bytes]),
                        link_bytes=np.array([t.link_bytes if IS_PUT[t.kind] else 0.0]),
                        wait=np.array([t.wait]), sig_count=np.array([len(t.signals)]),
                        sig_rank=np.array([r for r, _ in t.signals], np.int64),
                        sig_event=np.array([e for _, e in t.signals], np.int64)))
    for r in range(ep):
        b.set_events(r, np.array(thresholds.get(r, []), np.int64))
    return b.freeze()


def by_hand(graph: TaskGraph, worker: list[int], order: list[int] | None = None,
            workers: WorkerCounts = UNIT_WORKERS) -> Schedule:
    """A schedule with each task's worker given; queues run in ``order`` (default: task id)."""
    priority = np.arange(graph.num_tasks) if order is None else np.argsort(np.asarray(order))
    return schedule_from_assignment(graph, SchedulePolicy.CRITICAL_PATH, workers, np.asarray(worker),
                                    priority)

"""Provable lower bounds of a task graph on a hardware model: per-unit work over the
unit's workers, link-port occupancy (each with the shortest chain that must come before
and after it), the critical path with uncontended durations, and the compulsory HBM bytes
of the busiest rank over its bandwidth.  They hold for every replay of the graph
(``hpmoe.sim.simulate``), whatever the schedule."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.analysis import bottom_levels, top_levels
from ..ir.graph import TaskGraph, Unit
from ..ir.schedule import WorkerCounts
from .cost import TaskCosts, task_costs
from .hardware import HardwareModel
from .resources import MemorySystem


@dataclass(frozen=True)
class Bounds:
    """Lower bounds (seconds) of any replay of a graph on a hardware model.

    matrix_work / vector_work: max over ranks of the unit's total uncontended task
    time over its worker count, plus the earliest any of those tasks can start (head)
    and the shortest chain that must follow any of them (tail).  link: max over ranks,
    tiers and over egress / ingress of the port's total transfer time over its lanes,
    plus head (earliest issue of any of its puts) and tail (latency and shortest chain
    after any of them).  critical_path: longest dependency chain with uncontended
    durations.  memory: max over ranks of the compulsory HBM bytes (every distinct
    operand once, every access to one larger than the L2, plus the bytes no cache can
    save) over ``mem_bw``.  Task durations
    here are the least a task can take: its floor, or its uncacheable bytes at the
    whole ``mem_bw``.
    """

    matrix_work: float
    vector_work: float
    link: float
    critical_path: float
    memory: float = 0.0

    @property
    def work(self) -> float:
        return max(self.matrix_work, self.vector_work)

    @property
    def lower_bound(self) -> float:
        return max(self.work, self.link, self.critical_path, self.memory)


def bounds(graph: TaskGraph, costs: TaskCosts, workers: WorkerCounts,
           memory: MemorySystem | None = None) -> Bounds:
    """Lower bounds of ``graph`` on ``workers`` with ``costs`` and ``memory`` (see ``Bounds``;
    without ``memory``, tasks take their ``work`` and there is no memory term).

    Each resource bound is head + busy time + tail: a unit's worker with at least the
    average load cannot start before the earliest top level of the rank's tasks of
    that unit, and after its last task at least the shortest remaining chain of any of
    them follows; likewise for a link port, its puts and their transfers.
    """
    work, mem = costs.work, 0.0
    if memory is not None:
        work = np.maximum(costs.floor, memory.traffic.fixed / memory.bandwidth)
        need = memory.traffic.compulsory(graph.ep, graph.rank, memory.l2_bytes)
        mem = float(need.max(initial=0.0)) / memory.bandwidth
    duration = work + costs.transfer + costs.latency
    top = top_levels(graph, duration)
    after = bottom_levels(graph, duration) - duration
    return Bounds(matrix_work=_work_bound(graph, Unit.MATRIX, duration, top, after, workers.matrix),
                  vector_work=_work_bound(graph, Unit.VECTOR, duration, top, after, workers.vector),
                  link=_link_bound(graph, costs, work, top, after),
                  critical_path=float((top + duration).max(initial=0.0)), memory=mem)


def _work_bound(graph: TaskGraph, unit: Unit, duration: np.ndarray, top: np.ndarray, after: np.ndarray,
                workers: int) -> float:
    m = graph.unit == unit
    return _resource_bound(graph.rank[m], duration[m] / workers, top[m], after[m], graph.ep)


def _link_bound(graph: TaskGraph, costs: TaskCosts, work: np.ndarray, top: np.ndarray,
                after: np.ndarray) -> float:
    m = costs.transfer > 0
    if not m.any():
        return 0.0
    head, tail = top[m] + work[m], costs.latency[m] + after[m]
    tier = costs.tier[m].astype(np.int64)
    busy = costs.transfer[m] / np.take(costs.lanes, tier)
    return max(_resource_bound(port[m] + graph.ep * tier, busy, head, tail, 2 * graph.ep)
               for port in (graph.rank, graph.peer))


def _resource_bound(owner: np.ndarray, busy: np.ndarray, head: np.ndarray, tail: np.ndarray,
                    ep: int) -> float:
    """max over owners (ranks) of min head + total busy + min tail, 0 when none."""
    if not len(owner):
        return 0.0
    total = np.bincount(owner, weights=busy, minlength=ep)
    first = np.full(ep, np.inf)
    np.minimum.at(first, owner, head)
    last = np.full(ep, np.inf)
    np.minimum.at(last, owner, tail)
    used = np.isfinite(first)
    return float((first + total + last)[used].max())


def graph_bounds(graph: TaskGraph, hardware: HardwareModel) -> Bounds:
    """Bounds of ``graph`` on ``hardware`` (all its workers, its memory), without a schedule."""
    workers = WorkerCounts(matrix=hardware.matrix_workers, vector=hardware.vector_workers)
    return bounds(graph, task_costs(graph, hardware), workers, MemorySystem.of(graph, hardware))

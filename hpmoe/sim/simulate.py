"""Replay a ``Schedule`` on a ``HardwareModel``: a ``Timeline`` and provable lower bounds.

Semantics of the replay:
  1. every worker runs its queue in order; the task at the head of a queue starts as
     soon as the worker is free and the event it waits on reached its threshold;
  2. a task occupies its worker for its cost (``hpmoe.sim.cost``); it signals its events
     when it ends;
  3. every rank has one egress and one ingress link port, each serving one transfer
     at a time: a remote put, after its issue overhead, joins its rank's egress queue;
     a free egress port starts the earliest-issued of its puts whose peer's ingress
     port is free (puts to different peers are independent streams, as AIV-driven
     puts are: no head-of-line blocking), an ingress port that frees serves the
     egress ports waiting for it first come, first served; a transfer holds both ports
     for ``link_bytes / bandwidth`` and the put ends ``link_latency`` later.  The
     issuing vector worker is busy until the put ends.  O(issued puts of the rank) per
     port event besides the heap.

The loop keeps one heap of task ends and link events: O((tasks + signals) log tasks),
plain Python over lists.  ``Bounds`` hold for every replay of the graph on the
hardware, whatever the schedule: per-unit work over the unit's workers, link-port
occupancy (each with the shortest chain that must come before and after it), and the
critical path with uncontended durations.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..ir.analysis import GraphError, gather_csr, task_levels
from ..ir.graph import TaskGraph, Unit
from ..schedule.base import Schedule, SchedulePolicy, WorkerCounts
from ..schedule.verify import require_all_ranks, verify_schedule
from .cost import TaskCosts, task_costs
from .hardware import HardwareModel


@dataclass(frozen=True)
class Timeline:
    """Where and when every task ran; times in seconds from the region's start.

    Per task i, arrays [n]: kind (TaskKind values), rank, peer (destination rank of a
    put, else rank), unit (Unit values), worker (index within its rank and unit),
    start, end; link_start / link_end: the transfer's hold of the link ports (NaN for
    tasks without a transfer).  ``workers`` and ``ep`` name the tracks.
    """

    ep: int
    workers: WorkerCounts
    kind: np.ndarray
    rank: np.ndarray
    peer: np.ndarray
    unit: np.ndarray
    worker: np.ndarray
    start: np.ndarray
    end: np.ndarray
    link_start: np.ndarray
    link_end: np.ndarray

    @property
    def num_tasks(self) -> int:
        return len(self.kind)

    @property
    def makespan(self) -> float:
        """Seconds from the first start (time 0) to the last end."""
        return float(self.end.max(initial=0.0))


@dataclass(frozen=True)
class Bounds:
    """Lower bounds (seconds) of any replay of a graph on a hardware model.

    matrix_work / vector_work: max over ranks of the unit's total uncontended task
    time over its worker count, plus the earliest any of those tasks can start (head)
    and the shortest chain that must follow any of them (tail).  link: max over ranks
    and over egress / ingress of the port's total transfer time, plus head (earliest
    issue of any of its puts) and tail (latency and shortest chain after any of them).
    critical_path: longest dependency chain with uncontended durations.
    """

    matrix_work: float
    vector_work: float
    link: float
    critical_path: float

    @property
    def work(self) -> float:
        return max(self.matrix_work, self.vector_work)

    @property
    def lower_bound(self) -> float:
        return max(self.work, self.link, self.critical_path)


@dataclass(frozen=True)
class SimResult:
    """A replay: its timeline, the bounds of its graph and the policy that made it."""

    timeline: Timeline
    bounds: Bounds
    policy: SchedulePolicy

    @property
    def makespan(self) -> float:
        return self.timeline.makespan


def simulate(schedule: Schedule, hardware: HardwareModel, costs: TaskCosts | None = None) -> SimResult:
    """Replay ``schedule`` (all ranks together) on ``hardware``.

    ``costs`` defaults to ``task_costs(schedule.graph, hardware)``.  Raises ``GraphError``
    naming the blocked queues when the schedule cannot complete.
    """
    graph = schedule.graph
    require_all_ranks(graph)
    costs = task_costs(graph, hardware) if costs is None else costs
    if len(costs.work) != graph.num_tasks:
        raise ValueError(f"costs cover {len(costs.work)} tasks, the graph has {graph.num_tasks}")
    start, end, link_start, link_end = replay(schedule, costs)
    timeline = Timeline(ep=graph.ep, workers=schedule.workers, kind=graph.kind, rank=graph.rank,
                        peer=graph.peer, unit=graph.unit, worker=schedule.worker, start=start,
                        end=end, link_start=link_start, link_end=link_end)
    return SimResult(timeline=timeline, bounds=bounds(graph, costs, schedule.workers),
                     policy=schedule.policy)


def makespan(schedule: Schedule, costs: TaskCosts) -> float:
    """Simulated makespan (seconds) of ``schedule`` with precomputed ``costs``."""
    return float(replay(schedule, costs)[1].max(initial=0.0))


# ---------------------------------------------------------------------------- replay

def replay(schedule: Schedule, costs: TaskCosts) -> tuple[np.ndarray, ...]:
    """(start, end, link_start, link_end), each [n] float64 seconds, of a replay."""
    graph = schedule.graph
    state = _ReplayState(schedule, costs)
    state.run()
    if state.done != graph.num_tasks:
        raise GraphError(_stall_message(schedule, state))
    nan = np.full(graph.num_tasks, np.nan)
    has_link = costs.transfer > 0
    return (np.asarray(state.start), np.asarray(state.end),
            np.where(has_link, np.asarray(state.ports.link_start), nan),
            np.where(has_link, np.asarray(state.ports.link_end), nan))


END, ISSUE, LINK_DONE = 0, 1, 2  # heap entry codes: (time, 3 * task + code)


class LinkPorts:
    """Egress and ingress port of every rank (see the module docstring).

    Shares the caller's heap: ``issue`` and ``done`` push ``(time, 3 * i + LINK_DONE)``
    when a transfer starts and ``(time, 3 * i + END)`` when it ends, and record each
    transfer in ``link_start`` / ``link_end``.
    """

    def __init__(self, graph: TaskGraph, costs: TaskCosts, heap: list[tuple[float, int]]):
        self.src, self.dst = graph.rank.tolist(), graph.peer.tolist()
        self.transfer, self.latency = costs.transfer.tolist(), costs.latency.tolist()
        self.heap = heap
        self.egress_busy, self.ingress_busy = [False] * graph.ep, [False] * graph.ep
        self.egress_queue: list[list[int]] = [[] for _ in range(graph.ep)]
        self.ingress_waiting: list[deque[int]] = [deque() for _ in range(graph.ep)]
        self.waits_for: list[set[int]] = [set() for _ in range(graph.ep)]
        self.link_start, self.link_end = [0.0] * graph.num_tasks, [0.0] * graph.num_tasks

    def issue(self, i: int, now: float) -> None:
        """Put ``i`` joins its rank's egress queue."""
        self.egress_queue[self.src[i]].append(i)
        self.serve(self.src[i], now)

    def done(self, i: int, now: float) -> None:
        """Put ``i``'s transfer ended: free both ports, serve who waits for them."""
        self.link_end[i] = now
        heapq.heappush(self.heap, (now + self.latency[i], 3 * i + END))
        s, d = self.src[i], self.dst[i]
        self.egress_busy[s] = self.ingress_busy[d] = False
        waiting = self.ingress_waiting[d]
        while waiting and not self.ingress_busy[d]:
            r = waiting.popleft()
            self.waits_for[r].discard(d)
            self.serve(r, now)
        self.serve(s, now)

    def serve(self, r: int, now: float) -> None:
        """If rank ``r``'s egress is free, start its earliest-issued put whose peer's
        ingress is free; else queue ``r`` at the ingress ports its puts wait for."""
        queue = self.egress_queue[r]
        if self.egress_busy[r] or not queue:
            return
        for j, i in enumerate(queue):
            d = self.dst[i]
            if not self.ingress_busy[d]:
                del queue[j]
                self.egress_busy[r] = self.ingress_busy[d] = True
                self.link_start[i] = now
                heapq.heappush(self.heap, (now + self.transfer[i], 3 * i + LINK_DONE))
                return
        for i in queue:
            d = self.dst[i]
            if d not in self.waits_for[r]:
                self.waits_for[r].add(d)
                self.ingress_waiting[d].append(r)


class _ReplayState:
    """Lists (not numpy scalars) for the hot loop; see the module docstring.

    The heap holds ``(time, 3 * task + code)``: a task's end, a put's issue to its
    egress queue, or the end of a put's transfer.
    """

    def __init__(self, schedule: Schedule, costs: TaskCosts):
        g = schedule.graph
        n = g.num_tasks
        self.work, self.remote = costs.work.tolist(), (costs.transfer > 0).tolist()
        self.wait = g.wait_global().tolist()
        self.threshold = g.threshold.tolist()
        self.sig_ptr, self.signals = g.sig_ptr.tolist(), g.signals_global().tolist()
        self.queue_of = schedule.queue.tolist()
        self.qtask = schedule.queue_task.tolist()
        self.head = schedule.queue_ptr[:-1].tolist()
        self.tail = schedule.queue_ptr[1:].tolist()
        self.fire = [0.0 if t <= 0 else -1.0 for t in self.threshold]
        self.start, self.end = [0.0] * n, [0.0] * n
        self.blocked: dict[int, list[int]] = {}
        self.heap: list[tuple[float, int]] = []
        self.ports = LinkPorts(g, costs, self.heap)
        self.done = 0

    def begin(self, q: int, now: float) -> None:
        """Start the head task of queue ``q`` at ``now`` if its event has fired."""
        h = self.head[q]
        if h == self.tail[q]:
            return
        i = self.qtask[h]
        e = self.wait[i]
        if e >= 0 and self.fire[e] < 0.0:
            self.blocked.setdefault(e, []).append(q)
            return
        self.start[i] = now
        heapq.heappush(self.heap, (now + self.work[i], 3 * i + (ISSUE if self.remote[i] else END)))

    def run(self) -> None:
        for q in range(len(self.head)):
            self.begin(q, 0.0)
        heap, pop, begin, ports = self.heap, heapq.heappop, self.begin, self.ports
        count, threshold, fire = [0] * len(self.threshold), self.threshold, self.fire
        sig_ptr, signals, blocked, end = self.sig_ptr, self.signals, self.blocked, self.end
        while heap:
            now, code = pop(heap)
            i, kind = divmod(code, 3)
            if kind == ISSUE:
                ports.issue(i, now)
                continue
            if kind == LINK_DONE:
                ports.done(i, now)
                continue
            end[i] = now
            self.done += 1
            for s in range(sig_ptr[i], sig_ptr[i + 1]):
                e = signals[s]
                c = count[e] = count[e] + 1
                if c == threshold[e]:
                    fire[e] = now
                    for q in blocked.pop(e, ()):
                        begin(q, now)
            q = self.queue_of[i]
            self.head[q] += 1
            begin(q, now)


def _stall_message(schedule: Schedule, state: _ReplayState) -> str:
    verify_schedule(schedule)  # raises with the cycle or the unreachable threshold
    stuck = [q for q in range(len(state.head)) if state.head[q] < state.tail[q]]
    return (f"replay stalled with {schedule.graph.num_tasks - state.done} tasks left; blocked: "
            + "; ".join(schedule.describe_queue(q) for q in stuck[:5]))


# ---------------------------------------------------------------------------- bounds

def bounds(graph: TaskGraph, costs: TaskCosts, workers: WorkerCounts) -> Bounds:
    """Lower bounds of ``graph`` on ``workers`` with ``costs`` (see ``Bounds``).

    Each resource bound is head + busy time + tail: a unit's worker with at least the
    average load cannot start before the earliest top level of the rank's tasks of
    that unit, and after its last task at least the shortest remaining chain of any of
    them follows; likewise for a link port, its puts and their transfers.
    """
    duration = costs.duration
    top = top_levels(graph, duration)
    after = bottom_levels(graph, duration) - duration
    return Bounds(matrix_work=_work_bound(graph, Unit.MATRIX, duration, top, after, workers.matrix),
                  vector_work=_work_bound(graph, Unit.VECTOR, duration, top, after, workers.vector),
                  link=_link_bound(graph, costs, top, after),
                  critical_path=float((top + duration).max(initial=0.0)))


def _work_bound(graph: TaskGraph, unit: Unit, duration: np.ndarray, top: np.ndarray, after: np.ndarray,
                workers: int) -> float:
    m = graph.unit == unit
    return _resource_bound(graph.rank[m], duration[m] / workers, top[m], after[m], graph.ep)


def _link_bound(graph: TaskGraph, costs: TaskCosts, top: np.ndarray, after: np.ndarray) -> float:
    m = costs.transfer > 0
    if not m.any():
        return 0.0
    head, tail = top[m] + costs.work[m], costs.latency[m] + after[m]
    return max(_resource_bound(port[m], costs.transfer[m], head, tail, graph.ep)
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


def _level_groups(graph: TaskGraph) -> list[np.ndarray]:
    """Task ids per completion level, first level first."""
    level = task_levels(graph)
    order = np.argsort(level, kind="stable")
    cuts = np.searchsorted(level[order], np.arange(1, int(level.max(initial=-1)) + 1))
    return np.split(order, cuts) if len(order) else []


def _exact_events(graph: TaskGraph) -> np.ndarray:
    """[events + 1] bool: the event needs every one of its signals (threshold == signal
    count); chains are only followed through these, so the levels stay lower bounds.
    The last entry (False) stands for "no event" (wait id -1)."""
    total = np.bincount(graph.signals_global(), minlength=graph.num_events)
    return np.append(graph.threshold == total, False)


def top_levels(graph: TaskGraph, duration: np.ndarray) -> np.ndarray:
    """[n] seconds: earliest start of each task with unlimited workers and no ports."""
    wait, signals, exact = graph.wait_global(), graph.signals_global(), _exact_events(graph)
    fire = np.zeros(graph.num_events + 1)  # the last entry: "no event", stays 0
    top = np.zeros(graph.num_tasks)
    for t in _level_groups(graph):
        top[t] = fire[wait[t]]
        ev = gather_csr(graph.sig_ptr, signals, t)
        finish = np.repeat(top[t] + duration[t], graph.sig_ptr[t + 1] - graph.sig_ptr[t])
        np.maximum.at(fire, ev[exact[ev]], finish[exact[ev]])
    return top


def bottom_levels(graph: TaskGraph, duration: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
    """[n] seconds: duration + max(longest chain of any successor, ``extra``), i.e. the
    longest chain from each task's start to the end of the graph."""
    wait, signals, exact = graph.wait_global(), graph.signals_global(), _exact_events(graph)
    extra = np.zeros(graph.num_tasks) if extra is None else extra
    best = np.zeros(graph.num_events + 1)  # longest chain among each event's waiters
    b = np.zeros(graph.num_tasks)
    for t in reversed(_level_groups(graph)):
        counts = graph.sig_ptr[t + 1] - graph.sig_ptr[t]
        succ = np.zeros(len(t))
        np.maximum.at(succ, np.repeat(np.arange(len(t)), counts), best[gather_csr(graph.sig_ptr, signals, t)])
        b[t] = duration[t] + np.maximum(succ, extra[t])
        w = wait[t]
        keep = exact[w]
        np.maximum.at(best, w[keep], b[t][keep])
    return b


def graph_bounds(graph: TaskGraph, hardware: HardwareModel) -> Bounds:
    """Bounds of ``graph`` on ``hardware`` (all its workers), without a schedule."""
    workers = WorkerCounts(matrix=hardware.matrix_workers, vector=hardware.vector_workers)
    return bounds(graph, task_costs(graph, hardware), workers)

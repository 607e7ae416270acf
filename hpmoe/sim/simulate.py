"""Replay a ``Schedule`` on a ``HardwareModel``: a ``Timeline`` and provable lower bounds.

Semantics of the replay:
  1. every worker runs its queue in order; the task at the head of a queue starts as
     soon as the worker is free and the event it waits on reached its threshold;
  2. a task occupies its worker until both its ``floor`` (overhead + compute,
     ``hpmoe.sim.cost``) has passed and its HBM bytes have been served; it signals its
     events when it ends.  A remote put goes to the link after its floor (step 4); the
     read of its payload loads its rank's HBM meanwhile but delays nothing;
  3. memory, per rank: a GEMM tile looks its operands up in the rank's L2 (an LRU in
     the order tasks start, ``hpmoe.sim.memory``); its HBM bytes are its misses plus
     its output.  The rank's HBM serves every task with bytes left at once, in equal
     shares of ``mem_bw`` recomputed at each start and finish (processor sharing), so
     two tasks with B1 and B2 bytes both end by (B1 + B2) / mem_bw;
  4. links: every rank has one egress and one ingress port per tier (within a node,
     between nodes), each serving ``lanes`` transfers at once: a remote put joins
     its rank's egress queue of its tier; a free egress lane starts the earliest-issued
     of its puts whose peer has a free ingress lane (puts to different peers are
     independent streams: no head-of-line blocking); an ingress port that frees serves
     the egress ports waiting for it first come, first served; a transfer holds one
     lane of both ports for its ``transfer`` time and the put ends ``latency`` later.
     The issuing vector worker is busy until the put ends;
  5. host cores (``HardwareModel.host_cores`` > 0, a CPU host): the workers of a node's
     ranks are threads time-sharing its cores.  A task needs ``overhead + max(compute,
     HBM bytes / mem_bw)`` seconds of one core (its L2 misses as in 3, ``mem_bw`` one
     core's streaming rate; a remote put: its overhead), and every running task gets
     ``min(1, cores / running)`` of a core (processor sharing recomputed at each start and
     finish); HBM is then not shared (step 3's sharing is off).  With ``host_mem_bw``
     the host's memory is: a task with bytes also needs them served by its host's
     memory, which gives each task with bytes left ``min(mem_bw, host_mem_bw / n)``
     (processor sharing among the host's n such tasks); the task ends when both its
     core demand and its bytes are served.  A remote put whose
     transport burns host CPU (``HardwareModel.put_cpu``) adds that much demand on its
     host's cores when it goes to the link, as a job of its own that gates nothing.  A
     worker whose task's event had not fired when it got there sleeps on it and starts
     the task ``wake_latency`` after the event fires.

The loop keeps one heap of task, memory and link events: O((tasks + signals) log tasks),
plain Python over lists.  ``Bounds`` hold for every replay of the graph on the
hardware, whatever the schedule: per-unit work over the unit's workers, link-port
occupancy (each with the shortest chain that must come before and after it), the
critical path with uncontended durations, and the compulsory HBM bytes of the
busiest rank over its bandwidth.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ..ir.analysis import GraphError
from ..ir.graph import TaskGraph
from ..ir.schedule import Schedule, SchedulePolicy, WorkerCounts
from ..ir.schedule_verify import require_all_ranks, verify_schedule
from .bounds import Bounds, bounds
from .cost import TaskCosts, task_costs
from .hardware import HardwareModel
from .memory import LruCache
from .resources import CODES, END, ISSUE, SHARES, WAKE, WORK, HbmShare, HostCores, LinkPorts, MemorySystem


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
class MemoryStats:
    """What each rank's memory did in a replay, arrays [ep].

    hbm_bytes: bytes served by HBM (misses, outputs, vector and put traffic).
    l2_hit_bytes / l2_miss_bytes: cached-operand bytes found / not found in L2.
    busy: seconds during which some task had HBM bytes left (HBM at its full rate).
    task_bytes: [n] HBM bytes charged to each task.
    """

    hbm_bytes: np.ndarray
    l2_hit_bytes: np.ndarray
    l2_miss_bytes: np.ndarray
    busy: np.ndarray
    task_bytes: np.ndarray

    @property
    def l2_hit_rate(self) -> np.ndarray:
        """[ep] hit fraction of cached-operand bytes (1.0 where a rank has none)."""
        total = self.l2_hit_bytes + self.l2_miss_bytes
        return np.divide(self.l2_hit_bytes, total, out=np.ones_like(total), where=total > 0)


@dataclass(frozen=True)
class SimResult:
    """A replay: its timeline, the bounds of its graph, the policy that made it and what
    its memory did."""

    timeline: Timeline
    bounds: Bounds
    policy: SchedulePolicy
    memory: MemoryStats | None = None

    @property
    def makespan(self) -> float:
        return self.timeline.makespan


def simulate(schedule: Schedule, hardware: HardwareModel, costs: TaskCosts | None = None,
             entry: np.ndarray | None = None) -> SimResult:
    """Replay ``schedule`` (all ranks together) on ``hardware``, memory included.

    ``costs`` defaults to ``task_costs(schedule.graph, hardware)``.  ``entry``: [ep]
    seconds at which each rank enters the region (its workers start then; None: every
    rank at 0).  Raises ``GraphError`` naming the blocked queues when the schedule
    cannot complete.
    """
    graph = schedule.graph
    require_all_ranks(graph)
    costs = task_costs(graph, hardware) if costs is None else costs
    if len(costs.work) != graph.num_tasks:
        raise ValueError(f"costs cover {len(costs.work)} tasks, the graph has {graph.num_tasks}")
    memory = MemorySystem.of(graph, hardware)
    if entry is not None and (len(entry) != graph.ep or not (np.asarray(entry) >= 0).all()):
        raise ValueError(f"entry must hold one time >= 0 per rank ({graph.ep}), got {entry!r}")
    state = run_replay(schedule, costs, memory, HostCores.of(graph, hardware), entry)
    start, end, link_start, link_end = state.arrays(costs)
    timeline = Timeline(ep=graph.ep, workers=schedule.workers, kind=graph.kind, rank=graph.rank,
                        peer=graph.peer, unit=graph.unit, worker=schedule.worker, start=start,
                        end=end, link_start=link_start, link_end=link_end)
    return SimResult(timeline=timeline, bounds=bounds(graph, costs, schedule.workers, memory),
                     policy=schedule.policy, memory=state.memory_stats())


def makespan(schedule: Schedule, costs: TaskCosts, memory: MemorySystem | None = None,
             cores: HostCores | None = None) -> float:
    """Simulated makespan (seconds) of ``schedule`` with precomputed ``costs`` (and
    ``memory``: without, every task takes its ``work`` and memory is not shared; ``cores``:
    the host cores its ranks share, as ``simulate`` replays them)."""
    return float(replay(schedule, costs, memory, cores)[1].max(initial=0.0))


# ---------------------------------------------------------------------------- replay

def replay(schedule: Schedule, costs: TaskCosts, memory: MemorySystem | None = None,
           cores: HostCores | None = None) -> tuple[np.ndarray, ...]:
    """(start, end, link_start, link_end), each [n] float64 seconds, of a replay; with
    ``memory`` None every task occupies its worker for ``costs.work``, HBM unshared."""
    return run_replay(schedule, costs, memory, cores).arrays(costs)


def run_replay(schedule: Schedule, costs: TaskCosts, memory: MemorySystem | None,
               cores: HostCores | None = None, entry: np.ndarray | None = None) -> QueueReplay:
    state = QueueReplay(schedule, costs, memory, cores)
    state.run(entry)
    if state.done != schedule.graph.num_tasks:
        raise GraphError(_stall_message(schedule, state))
    return state


class Replay:
    """The replay's event loop over one graph, without a say in what runs next: lists
    (not numpy scalars) for the hot loop; see the module docstring.  ``launch`` starts
    a task now; a task's end counts its signals (``fired`` when an event reaches its
    threshold) and frees its worker (``freed``).  ``QueueReplay`` runs a schedule's
    queues; the critical-path list scheduler hands out tasks as workers free up.

    The heap holds ``(time, CODES * task + code)``: a task's end, a put's issue to its
    egress queue, the end of a put's transfer, or the end of a task's floor; and the
    HBM's finish events (negative codes, ``HbmShare``).
    """

    def __init__(self, graph: TaskGraph, costs: TaskCosts, memory: MemorySystem | None,
                 cores: HostCores | None = None):
        g = graph
        n = g.num_tasks
        self.graph = g
        self.remote = (costs.transfer > 0).tolist()
        self.wait = g.wait_global().tolist()
        self.threshold = g.threshold.tolist()
        self.count = [0] * len(self.threshold)
        self.sig_ptr, self.signals = g.sig_ptr.tolist(), g.signals_global().tolist()
        self.fire = [0.0 if t <= 0 else -1.0 for t in self.threshold]
        self.start, self.end = [0.0] * n, [0.0] * n
        self.heap: list[tuple[float, int]] = []
        self.ports = LinkPorts(g, costs, self.heap)
        self.done = 0
        self.memory = memory
        self.left = [0] * n
        self.rank = g.rank.tolist()
        self.cores = cores
        self.host_memory = None
        if cores is not None:
            self.share = cores.share(g.ep, self.heap)
        if memory is None:
            self.floor = costs.work.tolist()
            self.shares = [self.share] if cores is not None else []
            return
        self.floor = costs.floor.tolist()
        self.fixed = memory.traffic.fixed.tolist()
        self.ops = memory.traffic.operand.tolist()
        self.size = memory.traffic.size.tolist()
        self.caches = [LruCache(memory.l2_bytes) for _ in range(g.ep)]
        self.hbm = HbmShare(g.ep, memory.bandwidth, self.heap)
        if cores is None:
            self.share = self.hbm
        else:
            self.host_memory = cores.memory(g.ep, self.heap)
        self.shares = [self.share, self.host_memory]  # indexed by HbmShare.tag
        self.task_bytes = [0.0] * n

    def launch(self, i: int, now: float) -> None:
        """Task ``i`` starts at ``now`` (its event has fired)."""
        self.start[i] = now
        if self.cores is not None:
            self.begin_on_core(i, now)
            return
        if self.memory is None:
            heapq.heappush(self.heap, (now + self.floor[i], CODES * i + (ISSUE if self.remote[i] else END)))
            return
        nbytes = self.task_hbm_bytes(i)
        # a remote put's read streams while it is on the link: it loads HBM, gates nothing
        self.left[i] = 2 if nbytes > 0 and not self.remote[i] else 1
        heapq.heappush(self.heap, (now + self.floor[i], CODES * i + WORK))
        if nbytes > 0:
            self.hbm.add(self.rank[i], i, nbytes, now)

    def task_hbm_bytes(self, i: int) -> float:
        """Task ``i``'s HBM bytes: its fixed bytes and its L2 misses (looked up now)."""
        nbytes = self.fixed[i]
        a, b = self.ops[i]
        if a >= 0:
            cache = self.caches[self.rank[i]]
            nbytes += cache.access(a, self.size[a]) + cache.access(b, self.size[b])
        self.task_bytes[i] = nbytes
        return nbytes

    def begin_on_core(self, i: int, now: float) -> None:
        """Task ``i`` joins its host's cores with its demand, and its bytes its host's
        memory when that is shared (step 5)."""
        demand, nbytes, host = self.floor[i], 0.0, self.rank[i] // self.cores.ranks_per_host
        if self.memory is not None and not self.remote[i]:
            nbytes = self.task_hbm_bytes(i)
            demand = max(demand, self.cores.overhead + nbytes / self.cores.core_bw)
        self.left[i] = 1
        if self.host_memory is not None and nbytes > 0:
            self.left[i] = 2
            self.host_memory.add(host, i, nbytes, now)
        self.share.add(host, i, demand, now)

    def part_done(self, i: int, now: float) -> None:
        """One of task ``i``'s floor and memory is done; at the second, it ends (or a
        remote put goes to the link)."""
        self.left[i] -= 1
        if self.left[i] == 0:
            if self.remote[i]:
                self.ports.issue(i, now)
                if self.cores is not None and self.cores.put_cpu > 0:
                    host = self.rank[i] // self.cores.ranks_per_host
                    self.share.add(host, len(self.start) + i, self.cores.put_cpu, now)
            else:
                self.finish(i, now)

    def finish(self, i: int, now: float) -> None:
        """Task ``i`` ends: its signals count, then its worker is free."""
        self.end[i] = now
        self.done += 1
        count, threshold, fire = self.count, self.threshold, self.fire
        for s in range(self.sig_ptr[i], self.sig_ptr[i + 1]):
            e = self.signals[s]
            c = count[e] = count[e] + 1
            if c == threshold[e]:
                fire[e] = now
                self.fired(e, now)
        self.freed(i, now)

    def fired(self, e: int, now: float) -> None:
        """Event ``e`` reached its threshold at ``now``."""

    def freed(self, i: int, now: float) -> None:
        """Task ``i``'s worker is free at ``now``."""

    def woken(self, i: int, now: float) -> None:
        """The worker that slept on task ``i``'s event (or starts late) wakes at ``now``."""

    def loop(self) -> None:
        """Run the heap's events to the end."""
        heap, pop, ports, n = self.heap, heapq.heappop, self.ports, len(self.start)
        while heap:
            now, code = pop(heap)
            if code < 0:
                for i in self.shares[(-1 - code) % SHARES].finished(code, now):
                    if i < n and (self.cores is not None or not self.remote[i]):
                        self.part_done(i, now)  # i >= n: a put's background CPU, which gates nothing
                continue
            i, kind = divmod(code, CODES)
            if kind == END:
                self.finish(i, now)
            elif kind == WORK:
                self.part_done(i, now)
            elif kind == ISSUE:
                ports.issue(i, now)
            elif kind == WAKE:
                self.woken(i, now)
            else:
                ports.done(i, now)

    def arrays(self, costs: TaskCosts) -> tuple[np.ndarray, ...]:
        nan = np.full(len(self.start), np.nan)
        has_link = costs.transfer > 0
        return (np.asarray(self.start), np.asarray(self.end),
                np.where(has_link, np.asarray(self.ports.link_start), nan),
                np.where(has_link, np.asarray(self.ports.link_end), nan))

    def memory_stats(self) -> MemoryStats | None:
        if self.memory is None:
            return None
        ep = self.graph.ep
        task_bytes = np.asarray(self.task_bytes)
        return MemoryStats(hbm_bytes=np.bincount(self.graph.rank, weights=task_bytes, minlength=ep),
                           l2_hit_bytes=np.array([c.hits for c in self.caches]),
                           l2_miss_bytes=np.array([c.misses for c in self.caches]),
                           busy=np.asarray(self.hbm.busy), task_bytes=task_bytes)


class QueueReplay(Replay):
    """A schedule's replay: every worker runs its queue in order, its head task as soon
    as the worker is free and the task's event has fired (step 1)."""

    def __init__(self, schedule: Schedule, costs: TaskCosts, memory: MemorySystem | None,
                 cores: HostCores | None = None):
        super().__init__(schedule.graph, costs, memory, cores)
        self.queue_of = schedule.queue.tolist()
        self.qtask = schedule.queue_task.tolist()
        self.head = schedule.queue_ptr[:-1].tolist()
        self.tail = schedule.queue_ptr[1:].tolist()
        self.blocked: dict[int, list[int]] = {}

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
        self.launch(i, now)

    def wake(self, q: int, now: float) -> None:
        """Queue ``q``'s worker slept on its head task's event, which fired at ``now``."""
        if self.cores is None or self.cores.wake <= 0:
            self.begin(q, now)
            return
        heapq.heappush(self.heap, (now + self.cores.wake, CODES * self.qtask[self.head[q]] + WAKE))

    def fired(self, e: int, now: float) -> None:
        for q in self.blocked.pop(e, ()):
            self.wake(q, now)

    def freed(self, i: int, now: float) -> None:
        q = self.queue_of[i]
        self.head[q] += 1
        self.begin(q, now)

    def woken(self, i: int, now: float) -> None:
        self.begin(self.queue_of[i], now)

    def run(self, entry: np.ndarray | None = None) -> None:
        """Replay; ``entry`` [ep]: when each rank's workers start (None: all at 0)."""
        for q in range(len(self.head)):
            if self.head[q] == self.tail[q]:
                continue
            i = self.qtask[self.head[q]]
            if entry is None or entry[self.rank[i]] <= 0:
                self.begin(q, 0.0)
            else:  # the worker starts later: its first task begins as a woken one would
                heapq.heappush(self.heap, (float(entry[self.rank[i]]), CODES * i + WAKE))
        self.loop()


def _stall_message(schedule: Schedule, state: QueueReplay) -> str:
    verify_schedule(schedule)  # raises with the cycle or the unreachable threshold
    stuck = [q for q in range(len(state.head)) if state.head[q] < state.tail[q]]
    return (f"replay stalled with {schedule.graph.num_tasks - state.done} tasks left; blocked: "
            + "; ".join(schedule.describe_queue(q) for q in stuck[:5]))

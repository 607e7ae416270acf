"""Ours: list scheduling at tile level with cost-model priorities, all ranks together.

Plan of ``critical_path_schedule``:
  1. costs of every task (``hpmoe.sim.cost``) and its priority: the bottom level, i.e. the
     longest chain of uncontended durations from the task to the end of the graph.  A
     remote put's chain also counts the transfers queued behind it at its egress and
     ingress ports (ports are servers too), so that the GEMMs whose outputs must cross
     a busy link start early enough;
  2. a time-ordered list schedule of every rank at once, run by the simulator's replay
     loop (``sim.simulate.Replay``: its events, counters, link model and, without shared
     host cores, its memory system): whenever a worker is idle it takes the
     highest-priority ready task of its rank and unit.
     Remote puts go to a few dedicated vector workers per rank (``link_workers``: just
     enough to keep the link busy), so no other vector worker is ever parked behind a
     busy link.  Puts reach their real peers, so skew shows.
     The policy is greedy (no worker idles while a task it may run is ready), and the
     tasks that start at one instant start in the order the replay of its queues starts
     them (they look up the L2 in that order), so that replay reproduces its timeline;
  3. four such list schedules (``PutOrder``): puts in a fixed all-to-all order (what
     balanced routing wants: every stage pairs the ranks as a permutation), or by
     priority with each rank's remaining work counted (what skewed routing wants:
     the overloaded rank's data first), or reuse-aware (``reuse_rank``: expert by
     expert, each weight column tile over all of its expert's row blocks back to back,
     so that overlap does not cost L2 reuse), or in the order a plan of the link alone
     takes them (``link_plan``: the busiest ingress ports first, what skewed pair traffic
     wants); with the serial and hyperparallel orders of the same graph they are
     replayed by the simulator and the fastest is kept, so the result is never slower
     than the serial baseline (list scheduling has anomalies).
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, replace

import numpy as np

from ..ir.analysis import GraphError, bottom_levels, initially_ready
from ..ir.graph import IS_PUT, TaskGraph, Unit
from ..ir.schedule import Schedule, SchedulePolicy, WorkerCounts, schedule_from_assignment
from ..ir.schedule_verify import require_all_ranks
from ..sim.cost import COMBINE_KINDS, TaskCosts, task_costs
from ..sim.hardware import HardwareModel
from ..sim.resources import CODES, WAKE, HostCores, MemorySystem
from ..sim.simulate import Replay, makespan
from .hyperparallel import hyperparallel_schedule
from .link_plan import index_in_group, planned_put_order
from .serial import serial_schedule


class PutOrder(enum.Enum):
    """The order in which a rank's link workers take its ready remote puts."""

    STAGES = "stages"  # port_order: dispatch, then combine, peer by peer in stage order
    PRIORITY = "priority"  # bottom level with port and unit backlog: overloaded ranks first
    EXPERT = "expert"  # reuse-aware: expert by expert, a weight tile's row blocks back to back
    PLANNED = "planned"  # as a plan of the link alone takes them: the busiest ingress ports first


@dataclass(frozen=True)
class Candidate:
    """One schedule the critical-path policy considered, with its simulated makespan (s)."""

    name: str
    schedule: Schedule
    makespan: float


def critical_path_schedule(graph: TaskGraph, hardware: HardwareModel) -> Schedule:
    """The fastest candidate (see module plan), labelled ``CRITICAL_PATH``, naming the
    winner (``candidate``) and every candidate's simulated makespan (``candidates``)."""
    candidates = critical_path_candidates(graph, hardware)
    best = min(candidates, key=lambda c: c.makespan)  # first wins ties: the list schedule
    return replace(best.schedule, policy=SchedulePolicy.CRITICAL_PATH, candidate=best.name,
                   candidates=tuple((c.name, c.makespan) for c in candidates))


def critical_path_candidates(graph: TaskGraph, hardware: HardwareModel) -> tuple[Candidate, ...]:
    """The list schedules (one per ``PutOrder``), then the hyperparallel and serial
    orders of ``graph``, each with its simulated makespan on ``hardware`` (the replay
    ``simulate`` runs: memory system and shared host cores)."""
    require_all_ranks(graph)
    workers = hardware.workers
    costs = task_costs(graph, hardware)
    memory, cores = MemorySystem.of(graph, hardware), HostCores.of(graph, hardware)
    listed = []
    for o in PutOrder:
        if cores is None:  # the list's own timeline is the replay's (memory included): no second replay
            s, span = list_plan(graph, costs, workers, o, memory)
        else:  # the list replays no host cores
            s = list_plan(graph, costs, workers, o)[0]
            span = makespan(s, costs, memory, cores)
        listed.append(Candidate(name=f"list-{o.value}", schedule=s, makespan=span))
    orders = (("hyperparallel", hyperparallel_schedule(graph, workers)),
              ("serial", serial_schedule(graph, workers)))
    return (*listed, *(Candidate(name=name, schedule=s, makespan=makespan(s, costs, memory, cores))
                       for name, s in orders))


# ---------------------------------------------------------------------------- priorities

def put_stage(graph: TaskGraph) -> np.ndarray:
    """[n] the stage at which a put goes out: dispatch-like puts in order (peer - rank)
    mod EP, combine-like in order (rank - peer) mod EP, so that a rank returns results
    first to the peer whose data reached it first; 0 for other tasks."""
    ahead = (graph.peer - graph.rank) % graph.ep
    stage = np.where(COMBINE_KINDS[graph.kind], (-ahead) % graph.ep, ahead)
    return np.where(IS_PUT[graph.kind], stage, 0).astype(np.int64)


def put_round(graph: TaskGraph) -> np.ndarray:
    """[n] index of each put among the puts of the same direction from its rank to its
    peer (in task-id order); 0 for other tasks."""
    put = IS_PUT[graph.kind]
    pair = (graph.rank.astype(np.int64) * graph.ep + graph.peer) * 2 + COMBINE_KINDS[graph.kind]
    key = np.where(put, pair, -1)
    return np.where(put, index_in_group(key), 0)


def port_order(graph: TaskGraph, rounds: bool) -> np.ndarray:
    """[n] position of each task in the order ranks put on the link: dispatch-like
    before combine-like; then either peer by peer in stage order (``put_stage``), or,
    with ``rounds``, round by round (``put_round``: one put to each peer per round) and
    by stage within a round; then task id.  Under balanced routing every stage pairs
    the ranks as a permutation; rounds also keep a rank from queueing several puts
    for one busy peer while others are free (skewed routing)."""
    n = graph.num_tasks
    rnd = put_round(graph) if rounds else np.zeros(n, np.int64)
    order = np.lexsort((np.arange(n), put_stage(graph), rnd, COMBINE_KINDS[graph.kind]))
    position = np.empty(n, np.int64)
    position[order] = np.arange(n)
    return position


def port_backlog(graph: TaskGraph, costs: TaskCosts, position: np.ndarray) -> np.ndarray:
    """[n] seconds of transfers queued behind each remote put at its egress and at its
    ingress port, with ports served in ``position`` order; 0 for other tasks."""
    backlog = np.zeros(graph.num_tasks)
    for port in (graph.rank, graph.peer):
        order = np.lexsort((position, port))
        x = costs.transfer[order]
        group_total = np.bincount(port[order], weights=x, minlength=graph.ep)[port[order]]
        behind = group_total - np.cumsum(x) + _group_start_cumsum(port[order], x)
        backlog[order] = np.maximum(backlog[order], behind)
    return np.where(costs.transfer > 0, backlog, 0.0)


def _group_start_cumsum(group: np.ndarray, x: np.ndarray) -> np.ndarray:
    """For sorted ``group``: the running total of ``x`` before each element's group."""
    csum = np.cumsum(x)
    first = np.ones(len(group), bool)
    first[1:] = group[1:] != group[:-1]
    before = np.where(first, csum - x, 0.0)
    return np.maximum.accumulate(before)


def unit_backlog(graph: TaskGraph, costs: TaskCosts, workers: WorkerCounts, b: np.ndarray) -> np.ndarray:
    """[n] seconds the task's (rank, unit) still needs from the task's start, if the
    rank's workers of that unit run its tasks in order of decreasing ``b``: the work
    from the task on, over the worker count.  Large on an overloaded rank, so that
    the data its workers wait for is sent first."""
    n = graph.num_tasks
    pool = graph.rank.astype(np.int64) * len(Unit) + graph.unit
    order = np.lexsort((np.arange(n), -b, pool))
    work = costs.duration[order]
    total = np.bincount(pool[order], weights=work, minlength=graph.ep * len(Unit))[pool[order]]
    done_before = np.cumsum(work) - work - _group_start_cumsum(pool[order], work)
    count = np.where(graph.unit[order] == Unit.MATRIX, workers.matrix, workers.vector)
    backlog = np.empty(n)
    backlog[order] = (total - done_before) / count
    return backlog


def priority_rank(graph: TaskGraph, costs: TaskCosts, workers: WorkerCounts,
                  order: PutOrder = PutOrder.STAGES, puts: np.ndarray | None = None) -> np.ndarray:
    """[n] position of each task in priority order: bottom level descending (with port
    backlog, ports served in ``puts`` order, default ``put_order``; with
    ``PutOrder.PRIORITY`` also with unit backlog), then put stage, then task id.  Lower
    runs first."""
    if order is PutOrder.EXPERT:
        return reuse_rank(graph)
    port = port_backlog(graph, costs, put_order(graph, costs, workers, order) if puts is None else puts)
    b = bottom_levels(graph, costs.duration, port)
    if order is PutOrder.PRIORITY:
        extra = np.maximum(port, unit_backlog(graph, costs, workers, b))
        b = bottom_levels(graph, costs.duration, extra)
    ranked = np.lexsort((np.arange(graph.num_tasks), put_stage(graph), -b))
    position = np.empty(graph.num_tasks, np.int64)
    position[ranked] = np.arange(graph.num_tasks)
    return position


def put_order(graph: TaskGraph, costs: TaskCosts, workers: WorkerCounts, order: PutOrder) -> np.ndarray:
    """[n] the order in which ports serve remote puts: the link plan's with
    ``PutOrder.PLANNED`` (``link_plan``, with the link workers of ``link_workers``, or
    every vector worker where there are none), else ``port_order`` (by rounds with
    ``PutOrder.PRIORITY``)."""
    if order is not PutOrder.PLANNED:
        return port_order(graph, rounds=order is PutOrder.PRIORITY)
    senders = link_workers(workers, costs) or workers.vector
    return planned_put_order(graph, costs, put_stage(graph), senders)


def reuse_rank(graph: TaskGraph) -> np.ndarray:
    """[n] priority positions that keep an expert's weights hot in L2: tasks without an
    expert (shared experts, permute) first, then expert by expert (so dispatch sends
    every source's rows of local expert 0 first, as the paper's RATR order does); within
    an expert by kind, then column tile, then row block, so the matrix workers run a
    weight column tile over all of the expert's row blocks back to back; puts staggered."""
    n = graph.num_tasks
    expert = graph.expert.astype(np.int64)
    ranked = np.lexsort((np.arange(n), put_stage(graph), graph.row0, graph.col0, graph.kind, expert))
    position = np.empty(n, np.int64)
    position[ranked] = np.arange(n)
    return position


# ---------------------------------------------------------------------------- list schedule

def list_schedule(graph: TaskGraph, costs: TaskCosts, workers: WorkerCounts,
                  order: PutOrder = PutOrder.STAGES, memory: MemorySystem | None = None) -> Schedule:
    """Time-ordered list schedule of every rank (see module plan, step 2), remote puts
    taken in ``order``, with the memory system ``memory`` (None: every task takes its
    ``work``, as a replay without memory)."""
    return list_plan(graph, costs, workers, order, memory)[0]


def list_plan(graph: TaskGraph, costs: TaskCosts, workers: WorkerCounts, order: PutOrder = PutOrder.STAGES,
              memory: MemorySystem | None = None) -> tuple[Schedule, float]:
    """``list_schedule`` and the makespan (seconds) of its own timeline: the makespan a
    replay of it with ``memory`` and no host cores gives."""
    puts = put_order(graph, costs, workers, order)
    prio = priority_rank(graph, costs, workers, order, puts)
    port = prio if order in (PutOrder.PRIORITY, PutOrder.EXPERT) else puts
    state = _ListReplay(graph, costs, workers, prio, port, memory)
    state.loop()
    if state.assigned != graph.num_tasks:
        raise GraphError(f"{graph.num_tasks - state.assigned} tasks never became ready; "
                         "run hpmoe.ir.verify.verify_graph for the cause")
    s = schedule_from_assignment(graph, SchedulePolicy.CRITICAL_PATH, workers, np.asarray(state.worker),
                                 np.asarray(state.seq))
    return s, max(state.end, default=0.0)


def link_workers(workers: WorkerCounts, costs: TaskCosts) -> int:
    """Vector workers per rank reserved for remote puts, 0 for none (every worker does
    everything).  Enough that the link never waits for an issuing worker: a port serves
    ``lanes`` puts at once, and a worker spends issue + transfer + latency per put while
    a lane is busy only for the transfer, so k = ceil(lanes * (1 + (issue + latency) /
    transfer)) for the median put.  Only when that leaves at least half of the vector
    workers to the other tasks."""
    remote = costs.transfer > 0
    if not remote.any():
        return 0
    side = float(np.median(costs.work[remote] + costs.latency[remote]))
    lanes = max(costs.lanes)
    k = int(np.ceil(lanes * (1 + side / float(np.median(costs.transfer[remote])))))
    return k if 2 * k <= workers.vector else 0


class _ListReplay(Replay):
    """The list schedule as a replay (``sim.simulate.Replay``: its event loop, links,
    counters and ``memory``) that hands out tasks as workers free up, instead of running
    fixed queues.  Pools are (rank, unit): ``rank * 2 + unit``.  Every event of an instant
    is processed before the pools it touched are filled (the fill is a ``WAKE`` entry of a
    task id past the last, so it sorts after every task's entry of its time: no worker
    sleeps on an event here), so ties resolve by priority, not by heap order.  The tasks
    a fill hands out start in the order the queue replay starts them (``start_key``)."""

    def __init__(self, graph: TaskGraph, costs: TaskCosts, workers: WorkerCounts, prio: np.ndarray,
                 port: np.ndarray, memory: MemorySystem | None = None):
        super().__init__(graph, costs, memory)
        n, pools = graph.num_tasks, 2 * graph.ep
        self.fill_code = CODES * 2 * n + WAKE  # above every task's code
        self.prio, self.task_of = prio.tolist(), np.argsort(prio).tolist()
        self.port, self.put_of = port.tolist(), np.argsort(port).tolist()
        self.pool = (graph.rank.astype(np.int64) * 2 + graph.unit).tolist()
        self.waiters = _waiters(graph)
        self.plain: list[list[int]] = [[] for _ in range(pools)]
        self.puts: list[list[int]] = [[] for _ in range(pools)]
        self.links = link_workers(workers, costs)
        self.first_link = workers.vector - self.links
        self.idle = [list(range(workers.matrix if p % 2 == Unit.MATRIX else self.first_link))
                     for p in range(pools)]
        self.link_idle = [[] if p % 2 == Unit.MATRIX else list(range(self.first_link, workers.vector))
                          for p in range(pools)]
        self.worker, self.seq = [0] * n, [0] * n
        self.assigned = 0
        self.touched: set[int] = set(range(pools))
        self.filling = False
        self.starting: list[tuple[tuple[int, int], int]] = []
        self._start_order(workers)
        for i in np.flatnonzero(initially_ready(graph)).tolist():
            self.make_ready(i)
        self.fill_at(0.0)

    def _start_order(self, workers: WorkerCounts) -> None:
        """What orders the starts of one instant in the queue replay: the count of
        ``fired`` and ``freed`` calls so far when each event fired (``fired_at``) and
        each worker last fell free (``free_at``); at the start every worker is free, in
        queue order, and the events of threshold 0 have fired before."""
        queues = self.graph.ep * workers.per_rank
        self.calls = 0
        self.fired_at = [-queues - 1 if t <= 0 else 0 for t in self.threshold]
        self.free_at = [[self._queue(p, w, workers) - queues for w in range(workers.of(Unit(p % 2)))]
                        for p in range(2 * self.graph.ep)]

    @staticmethod
    def _queue(p: int, w: int, workers: WorkerCounts) -> int:
        """The global queue id of worker ``w`` of pool ``p`` (``Schedule.queue``)."""
        return p // 2 * workers.per_rank + (w if p % 2 == Unit.MATRIX else workers.matrix + w)

    def make_ready(self, i: int) -> None:
        if self.remote[i]:
            heapq.heappush(self.puts[self.pool[i]], self.port[i])
        else:
            heapq.heappush(self.plain[self.pool[i]], self.prio[i])

    def fill_at(self, now: float) -> None:
        if not self.filling:
            self.filling = True
            heapq.heappush(self.heap, (now, self.fill_code))

    def fired(self, e: int, now: float) -> None:
        self.calls += 1
        self.fired_at[e] = self.calls
        for j in self.waiters[e]:
            self.make_ready(j)
            self.touched.add(self.pool[j])
        self.fill_at(now)

    def freed(self, i: int, now: float) -> None:
        p, w = self.pool[i], self.worker[i]
        self.calls += 1
        self.free_at[p][w] = self.calls
        linker = p % 2 == Unit.VECTOR and w >= self.first_link
        heapq.heappush(self.link_idle[p] if linker else self.idle[p], w)
        self.touched.add(p)
        self.fill_at(now)

    def woken(self, i: int, now: float) -> None:
        """The fill of every pool the instant's events touched."""
        touched, self.touched, self.filling = self.touched, set(), False
        for p in sorted(touched):
            self.fill(p, now)
        starting, self.starting = sorted(self.starting), []
        for _, i in starting:
            self.seq[i] = self.assigned
            self.assigned += 1
            self.launch(i, now)

    def fill(self, p: int, now: float) -> None:
        """Give ready tasks of pool ``p`` to its idle workers: link workers take remote
        puts in ``port_order``; the others the best ready task (by priority), puts
        included only when the rank has no link workers."""
        plain, puts, idle, link_idle = self.plain[p], self.puts[p], self.idle[p], self.link_idle[p]
        while link_idle and puts:
            self.assign(self.put_of[heapq.heappop(puts)], heapq.heappop(link_idle), now)
        mixed = self.links == 0
        while idle and (plain or (mixed and puts)):
            put = self.put_of[puts[0]] if mixed and puts else -1
            if plain and (put < 0 or plain[0] < self.prio[put]):
                i = self.task_of[heapq.heappop(plain)]
            else:
                i = put
                heapq.heappop(puts)
            self.assign(i, heapq.heappop(idle), now)

    def assign(self, i: int, w: int, now: float) -> None:
        """Task ``i`` goes to worker ``w``; it starts at the end of the fill (``woken``)."""
        self.worker[i] = w
        self.starting.append((self.start_key(i, w), i))

    def start_key(self, i: int, w: int) -> tuple[int, int]:
        """When the queue replay starts task ``i`` on worker ``w`` within this instant: at
        the worker's ``freed`` if the task's event had fired by then; else at the event's
        ``fired``, where the workers asleep on it wake in the order they fell asleep."""
        free, e = self.free_at[self.pool[i]][w], self.wait[i]
        fired = self.fired_at[e] if e >= 0 else -(1 << 62)
        return (free, -1) if fired < free else (fired, free)


def _waiters(graph: TaskGraph) -> list[list[int]]:
    wait = graph.wait_global()
    has = np.flatnonzero(wait >= 0)
    order = has[np.argsort(wait[has], kind="stable")]
    cuts = np.cumsum(np.bincount(wait[has], minlength=graph.num_events))[:-1]
    return [part.tolist() for part in np.split(order, cuts)]

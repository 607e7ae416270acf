"""A plan of the link alone: the order in which each rank's link workers take its remote
puts so that skewed pair traffic keeps every port busy (``PutOrder.PLANNED``).

Plan of ``planned_put_order``:
  1. every remote put is ready at its top level (uncontended, ``top_levels``); a
     combine-like put (``mirror_puts``) as much later as the dispatch-like put whose rows
     it returns ends late in this plan (its rows must reach the experts first);
  2. the link ports of the simulator's replay (``sim.resources.LinkPorts``) serve the
     puts, issued by ``senders`` workers per rank, each busy from a put's issue to its
     signal, as the list schedule's link workers are;
  3. a free worker takes a ready dispatch-like put before a combine-like one; among the
     ingress ports its rank has ready puts for, it sends to one with a free lane
     (counting the puts already taken for it) and, among those, to the one with the
     most bytes still to receive from every rank (longest remaining work first: the
     overloaded ports are never left idle); then in stage order, then by task id.
Under balanced routing the ports' remaining work stays nearly equal and ties fall to the
stage order; under skew a rank sends to the busiest ports first.  Deterministic: a function
of the graph and its costs.
"""

from __future__ import annotations

import heapq

import numpy as np

from ..ir.analysis import top_levels
from ..ir.graph import TaskGraph
from ..sim.cost import COMBINE_KINDS, TaskCosts
from ..sim.resources import CODES, END, ISSUE, LINK_DONE, WAKE, LinkPorts


def index_in_group(key: np.ndarray) -> np.ndarray:
    """[n] the index of each entry among the entries with its ``key``, in position order."""
    n = len(key)
    order = np.lexsort((np.arange(n), key))
    k = key[order]
    first = np.ones(n, bool)
    first[1:] = k[1:] != k[:-1]
    index = np.empty(n, np.int64)
    index[order] = np.arange(n) - np.maximum.accumulate(np.where(first, np.arange(n), 0))
    return index


def mirror_puts(graph: TaskGraph, remote: np.ndarray) -> np.ndarray:
    """[n] for each remote combine-like put from rank d to rank s, the remote dispatch-like
    put from s to d with the same index among its pair's puts (task-id order): the put
    whose rows it returns; -1 for every other task and where no such put exists."""
    n, ep = graph.num_tasks, graph.ep
    combine = COMBINE_KINDS[graph.kind]
    src = np.where(combine, graph.peer, graph.rank).astype(np.int64)
    dst = np.where(combine, graph.rank, graph.peer).astype(np.int64)
    key = np.where(remote, (src * ep + dst) * 2 + combine, -1)
    index = index_in_group(key)
    sent = {(int(key[i]) // 2, int(index[i])): i for i in np.flatnonzero(remote & ~combine)}
    mirror = np.full(n, -1, np.int64)
    for i in np.flatnonzero(remote & combine):
        mirror[i] = sent.get((int(key[i]) // 2, int(index[i])), -1)
    return mirror


def planned_put_order(graph: TaskGraph, costs: TaskCosts, stage: np.ndarray, senders: int) -> np.ndarray:
    """[n] position of each task in the order the plan takes remote puts (see module
    plan; every other task first), with ``senders`` link workers per rank (> 0) and the
    ready puts for one port in ``stage`` order, then task id.  Ranks' positions
    interleave: a rank's k-th put comes after every rank's (k-1)-th."""
    plan = _LinkPlan(graph, costs, stage, senders)
    plan.run()
    order = np.lexsort((np.arange(graph.num_tasks), np.asarray(plan.position)))
    position = np.empty(graph.num_tasks, np.int64)
    position[order] = np.arange(graph.num_tasks)
    return position


class _LinkPlan:
    """The plan's state: lists for the hot loop.  Heap entries ``(time, CODES * put + code)``:
    WAKE a put is ready, ISSUE it joins its egress queue, LINK_DONE and END as in
    ``LinkPorts``."""

    def __init__(self, graph: TaskGraph, costs: TaskCosts, stage: np.ndarray, senders: int):
        remote = costs.transfer > 0
        ep, tier = graph.ep, costs.tier.astype(np.int64)
        self.heap: list[tuple[float, int]] = []
        self.ports = LinkPorts(graph, costs, self.heap)
        self.dst = (graph.peer + ep * tier).tolist()
        self.lanes = [costs.lanes[0]] * ep + [costs.lanes[1]] * ep
        self.rank, self.work = graph.rank.tolist(), costs.work.tolist()
        self.transfer = costs.transfer.tolist()
        self.combine = COMBINE_KINDS[graph.kind].tolist()
        self.key = list(zip(stage.tolist(), range(graph.num_tasks), strict=True))
        self.left = np.bincount(graph.peer[remote] + ep * tier[remote], weights=costs.transfer[remote],
                                minlength=2 * ep).tolist()
        self.taken = [0] * (2 * ep)
        self.ready: list[list[dict[int, list]]] = [[{}, {}] for _ in range(ep)]
        self.free, self.count = [senders] * ep, [0] * ep
        self.position = [-1] * graph.num_tasks  # the plan's count of its rank's puts before it
        self._release(graph, costs, remote)

    def _release(self, graph: TaskGraph, costs: TaskCosts, remote: np.ndarray) -> None:
        """Every dispatch-like (or unmirrored) put becomes ready at its top level; the rest
        wait for their mirror's end (``done``)."""
        self.top = top_levels(graph, costs.duration)
        self.end_top = (self.top + costs.duration).tolist()
        mirror = mirror_puts(graph, remote)
        self.returns: dict[int, list[int]] = {}
        for i in np.flatnonzero(remote).tolist():
            if mirror[i] >= 0:
                self.returns.setdefault(int(mirror[i]), []).append(i)
            else:
                heapq.heappush(self.heap, (float(self.top[i]), CODES * i + WAKE))
        self.top = self.top.tolist()

    def run(self) -> None:
        """The event loop; the ranks an instant's events touched fill their free workers
        once every event of that instant is processed."""
        heap, ports, touched = self.heap, self.ports, set()
        while heap:
            now, code = heapq.heappop(heap)
            i, kind = divmod(code, CODES)
            if kind == WAKE:
                self._ready(i)
            elif kind == ISSUE:
                ports.issue(i, now)
            elif kind == LINK_DONE:
                self.taken[self.dst[i]] -= 1
                ports.done(i, now)
            elif kind == END:
                self._ended(i, now)
            touched.add(self.rank[i])
            if not heap or heap[0][0] > now:
                for r in sorted(touched):
                    self._fill(r, now)
                touched = set()

    def _ready(self, i: int) -> None:
        by_port = self.ready[self.rank[i]][self.combine[i]]
        heapq.heappush(by_port.setdefault(self.dst[i], []), self.key[i])

    def _ended(self, i: int, now: float) -> None:
        """Put ``i`` signalled: its worker is free and the puts returning its rows are
        ready as much later than their top level as it ended after its own."""
        self.free[self.rank[i]] += 1
        late = now - self.end_top[i]
        for j in self.returns.pop(i, ()):
            heapq.heappush(self.heap, (self.top[j] + late, CODES * j + WAKE))

    def _fill(self, r: int, now: float) -> None:
        while self.free[r]:
            i = self._pick(r)
            if i < 0:
                return
            d = self.dst[i]
            self.taken[d] += 1
            self.left[d] -= self.transfer[i]
            self.free[r] -= 1
            self.position[i], self.count[r] = self.count[r], self.count[r] + 1
            heapq.heappush(self.heap, (now + self.work[i], CODES * i + ISSUE))

    def _pick(self, r: int) -> int:
        """The next put of rank ``r`` (module plan, step 3), or -1 when none is ready."""
        for by_port in self.ready[r]:
            if by_port:
                d = min(by_port, key=lambda p: (self.taken[p] >= self.lanes[p], -self.left[p], by_port[p][0]))
                puts = by_port[d]
                i = heapq.heappop(puts)[1]
                if not puts:
                    del by_port[d]
                return i
        return -1

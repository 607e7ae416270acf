"""Resources a replay contends for, shared by the simulator's replay and the
critical-path scheduler's list scheduling (a leaf: it imports neither).

Both keep one heap of ``(time, CODES * task + code)`` entries: ``LinkPorts`` serves
puts through every rank's egress and ingress ports and lanes, ``HbmShare`` shares each
rank's HBM bandwidth among the tasks moving bytes, and ``MemorySystem`` says what the
memory charges (per-task traffic through the L2, bytes/s per rank).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..ir.graph import TaskGraph
from .cost import TaskCosts
from .hardware import HardwareModel
from .memory import MemoryTraffic, memory_traffic


@dataclass(frozen=True)
class MemorySystem:
    """The memory a replay charges: per-task traffic, L2 bytes and HBM bytes/s per rank."""

    traffic: MemoryTraffic
    l2_bytes: float
    bandwidth: float

    @classmethod
    def of(cls, graph: TaskGraph, hardware: HardwareModel) -> MemorySystem | None:
        """The memory of ``hardware``; None when it is a per-worker roofline model
        (``HardwareModel.shared_hbm`` False)."""
        if not hardware.shared_hbm:
            return None
        return cls(traffic=memory_traffic(graph), l2_bytes=hardware.l2_bytes, bandwidth=hardware.mem_bw)


END, ISSUE, LINK_DONE, WORK = 0, 1, 2, 3  # heap entry codes: (time, CODES * task + code)
CODES = 4


class LinkPorts:
    """Egress and ingress ports of every rank and tier (see the module docstring).

    Port ``rank + ep * tier``.  Shares the caller's heap: ``issue`` and ``done`` push
    ``(time, CODES * i + LINK_DONE)`` when a transfer starts and ``(time, CODES * i + END)``
    when it ends, and record each transfer in ``link_start`` / ``link_end``.
    """

    def __init__(self, graph: TaskGraph, costs: TaskCosts, heap: list[tuple[float, int]]):
        ep, tier = graph.ep, costs.tier.astype(np.int64)
        self.src, self.dst = (graph.rank + ep * tier).tolist(), (graph.peer + ep * tier).tolist()
        self.transfer, self.latency = costs.transfer.tolist(), costs.latency.tolist()
        self.heap = heap
        lanes = [costs.lanes[0]] * ep + [costs.lanes[1]] * ep
        self.egress_free, self.ingress_free = list(lanes), list(lanes)
        self.egress_queue: list[list[int]] = [[] for _ in range(2 * ep)]
        self.ingress_waiting: list[deque[int]] = [deque() for _ in range(2 * ep)]
        self.waits_for: list[set[int]] = [set() for _ in range(2 * ep)]
        self.link_start, self.link_end = [0.0] * graph.num_tasks, [0.0] * graph.num_tasks

    def issue(self, i: int, now: float) -> None:
        """Put ``i`` joins its rank's egress queue."""
        self.egress_queue[self.src[i]].append(i)
        self.serve(self.src[i], now)

    def done(self, i: int, now: float) -> None:
        """Put ``i``'s transfer ended: free a lane of both ports, serve who waits for them."""
        self.link_end[i] = now
        heapq.heappush(self.heap, (now + self.latency[i], CODES * i + END))
        s, d = self.src[i], self.dst[i]
        self.egress_free[s] += 1
        self.ingress_free[d] += 1
        waiting = self.ingress_waiting[d]
        while waiting and self.ingress_free[d]:
            r = waiting.popleft()
            self.waits_for[r].discard(d)
            self.serve(r, now)
        self.serve(s, now)

    def serve(self, r: int, now: float) -> None:
        """While port ``r`` has a free egress lane, start its earliest-issued put whose
        peer has a free ingress lane; queue ``r`` at the ingress ports the rest wait for."""
        queue = self.egress_queue[r]
        j = 0
        while self.egress_free[r] and j < len(queue):
            i = queue[j]
            d = self.dst[i]
            if not self.ingress_free[d]:
                j += 1
                continue
            del queue[j]
            self.egress_free[r] -= 1
            self.ingress_free[d] -= 1
            self.link_start[i] = now
            heapq.heappush(self.heap, (now + self.transfer[i], CODES * i + LINK_DONE))
        if not self.egress_free[r]:
            return
        for i in queue:
            d = self.dst[i]
            if d not in self.waits_for[r]:
                self.waits_for[r].add(d)
                self.ingress_waiting[d].append(r)


class HbmShare:
    """Processor sharing of each rank's HBM: every task with bytes left gets an equal
    share of ``bandwidth``.  Per rank a virtual clock ``served`` counts the bytes each
    active task has received; a task of B bytes that joined at ``served = s`` is done
    at ``served = s + B``.  Finish events go on the caller's heap with code
    ``-1 - (rank + ep * version)``; a newer version makes older events stale."""

    def __init__(self, ep: int, bandwidth: float, heap: list[tuple[float, int]]):
        self.ep, self.bw, self.heap = ep, bandwidth, heap
        self.served, self.since = [0.0] * ep, [0.0] * ep
        self.active: list[list[tuple[float, int]]] = [[] for _ in range(ep)]
        self.version, self.busy = [0] * ep, [0.0] * ep

    def advance(self, r: int, now: float) -> None:
        n = len(self.active[r])
        if n:
            self.served[r] += (now - self.since[r]) * self.bw / n
            self.busy[r] += now - self.since[r]
        self.since[r] = now

    def add(self, r: int, i: int, nbytes: float, now: float) -> None:
        self.advance(r, now)
        heapq.heappush(self.active[r], (self.served[r] + nbytes, i))
        self.notify(r, now)

    def notify(self, r: int, now: float) -> None:
        self.version[r] += 1
        active = self.active[r]
        if active:
            t = now + (active[0][0] - self.served[r]) * len(active) / self.bw
            heapq.heappush(self.heap, (max(t, now), -1 - (r + self.ep * self.version[r])))

    def finished(self, code: int, now: float) -> list[int]:
        """Tasks whose bytes are all served at ``now`` (none for a stale event)."""
        version, r = divmod(-1 - code, self.ep)
        if version != self.version[r]:
            return []
        self.advance(r, now)
        active = self.active[r]
        # bytes left that the clock can no longer resolve count as served
        limit = self.served[r] + max(1e-6, self.bw * max(now, 1e-9) * 1e-12 / max(len(active), 1))
        done = []
        while active and active[0][0] <= limit:
            done.append(heapq.heappop(active)[1])
        self.notify(r, now)
        return done

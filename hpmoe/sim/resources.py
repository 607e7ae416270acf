"""Resources a replay contends for, shared by the simulator's replay and the
critical-path scheduler's list scheduling (a leaf: it imports neither).

Both keep one heap of ``(time, CODES * task + code)`` entries: ``LinkPorts`` serves
puts through every rank's egress and ingress ports and lanes, ``HbmShare`` shares each
rank's HBM bandwidth among the tasks moving bytes (or a host's cores, or a host's
memory), and ``MemorySystem`` says what the memory charges (per-task traffic through
the L2, bytes/s per rank).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..ir.graph import TaskGraph
from .cost import TaskCosts, kernel_bytes
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
        return cls(traffic=memory_traffic(graph, kernel_bytes(graph, hardware)), l2_bytes=hardware.l2_bytes,
                   bandwidth=hardware.mem_bw)


@dataclass(frozen=True)
class HostCores:
    """The cores a node's ranks share (``HardwareModel.host_cores``): ``cores`` per host of
    ``ranks_per_host`` ranks; a task's demand on its core is ``overhead`` + max(compute,
    bytes / ``core_bw``), ``core_bw`` one core's streaming bytes/s; a worker that slept on
    its task's event starts it ``wake`` seconds after the event; a remote put burns
    ``put_cpu`` seconds of a core while on the link.  ``host_bw``: bytes/s the
    host's memory serves while every core streams (``HardwareModel.host_mem_bw``), shared
    by the host's tasks with bytes left, each at most ``core_bw``; 0: each core streams at
    ``core_bw`` whatever the others do."""

    cores: float
    ranks_per_host: int
    core_bw: float
    overhead: float
    wake: float = 0.0
    host_bw: float = 0.0
    put_cpu: float = 0.0

    @classmethod
    def of(cls, graph: TaskGraph, hardware: HardwareModel) -> HostCores | None:
        """None when every worker has its own core (``host_cores`` 0)."""
        if hardware.host_cores <= 0:
            return None
        return cls(cores=hardware.host_cores, ranks_per_host=max(1, graph.ep // max(graph.nodes, 1)),
                   core_bw=hardware.mem_bw, overhead=hardware.task_overhead, wake=hardware.wake_latency,
                   host_bw=hardware.host_mem_bw, put_cpu=hardware.put_cpu)

    def hosts(self, ep: int) -> int:
        """Hosts of ``ep`` ranks."""
        return -(-ep // self.ranks_per_host)

    def share(self, ep: int, heap: list[tuple[float, int]]) -> HbmShare:
        """The processor-sharing state of every host's cores (demand in core-seconds)."""
        return HbmShare(self.hosts(ep), self.cores, heap, cap=1.0, eps=1e-15)

    def memory(self, ep: int, heap: list[tuple[float, int]]) -> HbmShare | None:
        """The sharing of every host's memory bandwidth (demand in bytes), on the heap's
        second code range; None when ``host_bw`` is 0."""
        if self.host_bw <= 0:
            return None
        return HbmShare(self.hosts(ep), self.host_bw, heap, cap=self.core_bw, tag=1)


END, ISSUE, LINK_DONE, WORK, WAKE = 0, 1, 2, 3, 4  # heap entry codes: (time, CODES * task + code)
CODES = 5
SHARES = 2  # HbmShare code ranges on one heap: a share's finish codes are -1 - (tag + SHARES * k)


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
    """Processor sharing of one resource per group (each rank's HBM, or each host's
    cores): every task with demand left gets ``min(cap, capacity / n)`` of it per
    second, n the group's active tasks.  Per group a virtual clock ``served`` counts
    what each active task has received; a task of demand D that joined at
    ``served = s`` is done at ``served = s + D``.  Finish events go on the caller's
    heap with code ``-1 - (tag + SHARES * (group + groups * version))``: ``tag`` (below
    ``SHARES``) tells the shares of one heap apart, a newer version makes older events
    stale.  HBM: bytes, capacity ``mem_bw``, no cap.  Cores: seconds of one core,
    capacity the host's cores, cap 1 (a task runs on one core at most).  A host's
    memory: bytes, capacity ``host_mem_bw``, cap one core's rate.  ``eps``: demand left
    below which a task counts as served (in the demand's unit)."""

    def __init__(self, groups: int, capacity: float, heap: list[tuple[float, int]], cap: float = np.inf,
                 eps: float = 1e-6, tag: int = 0):
        if not 0 <= tag < SHARES:
            raise ValueError(f"HbmShare.tag must be in [0, {SHARES}), got {tag!r}")
        self.ep, self.bw, self.cap, self.heap, self.eps, self.tag = groups, capacity, cap, heap, eps, tag
        self.served, self.since = [0.0] * groups, [0.0] * groups
        self.active: list[list[tuple[float, int]]] = [[] for _ in range(groups)]
        self.version, self.busy = [0] * groups, [0.0] * groups

    def rate(self, n: int) -> float:
        """What each of ``n`` active tasks gets per second."""
        return min(self.cap, self.bw / n)

    def advance(self, r: int, now: float) -> None:
        n = len(self.active[r])
        if n:
            self.served[r] += (now - self.since[r]) * self.rate(n)
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
            t = now + (active[0][0] - self.served[r]) / self.rate(len(active))
            code = -1 - (self.tag + SHARES * (r + self.ep * self.version[r]))
            heapq.heappush(self.heap, (max(t, now), code))

    def finished(self, code: int, now: float) -> list[int]:
        """Tasks whose demand is all served at ``now`` (none for a stale event)."""
        version, r = divmod((-1 - code) // SHARES, self.ep)
        if version != self.version[r]:
            return []
        self.advance(r, now)
        active = self.active[r]
        # demand left that the clock can no longer resolve counts as served
        limit = self.served[r] + max(self.eps, self.rate(max(len(active), 1)) * max(now, 1e-9) * 1e-12)
        done = []
        while active and active[0][0] <= limit:
            done.append(heapq.heappop(active)[1])
        self.notify(r, now)
        return done

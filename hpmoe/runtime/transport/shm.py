"""``shm`` transport: puts are copies into the peer's segment of the symmetric
heap followed by atomic adds on the peer's counters (data first: the add is a
locked read-modify-write, a full barrier).  Peer death is noticed through pidfds
(the kernel reports exit, including SIGKILL), aborts through the peers' abort
words."""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable

import numpy as np
import torch

from ...exec.program import PeerView
from ..counters import Counters
from .base import Step, Transport, TransportKind
from .heap import HeapNeed, SymmetricHeap


class ShmTransport(Transport):
    """``world`` ranks of one host.  ``pids[r]`` is rank r's process id;
    ``all_gather`` is a collective of all of them (``SymmetricHeap``; used only when
    a segment grows)."""

    kind = TransportKind.SHM

    def __init__(self, rank: int, world: int, job: str, pids: list[int],
                 all_gather: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__(rank, world)
        self.heap = SymmetricHeap(job, rank, world, pids, all_gather)
        self._pre = None
        self._views: list[dict[str, torch.Tensor]] = []
        self._counters: list[Counters] = []
        self._died: str | None = None
        self._watch = _PeerWatch({r: p for r, p in enumerate(pids) if r != rank}, self._on_death)

    def begin(self) -> None:
        self._pre = self.heap.counters(self.rank).snapshot() if self.heap.mapped(self.rank) else None

    def prepare(self, step: Step) -> dict[str, torch.Tensor]:
        return self.map_region(_needs(step, self.world))

    def map_region(self, needs: list[HeapNeed]) -> dict[str, torch.Tensor]:
        """Size every rank's segment for ``needs`` (collective when one grows), set
        ``base`` and the views puts write into; returns this rank's tensors."""
        grown = self.heap.ensure(needs)
        self.counters = self.heap.counters(self.rank)
        fresh = self.rank in grown or self._pre is None
        self.base = self.counters.snapshot() * 0 if fresh else self._pre
        self._views = [self.heap.tensors(r, needs[r]) for r in range(self.world)]
        self._counters = [self.heap.counters(r) for r in range(self.world)]
        return self._views[self.rank]

    def put(self, dst_rank: int, dst: PeerView, src: torch.Tensor, signals: tuple[int, ...],
            seq: int) -> None:
        self.view(dst_rank, dst.field)[dst.row0:dst.row0 + dst.rows].copy_(src)
        add = self._counters[dst_rank].add
        for e in signals:
            add(e)

    def view(self, rank: int, field: str) -> torch.Tensor:
        """Rank ``rank``'s symmetric tensor ``field`` as this rank maps it."""
        return self._views[rank][field]

    def signal(self, rank: int, event: int) -> None:
        """Add one to rank ``rank``'s event ``event`` (no data)."""
        self._counters[rank].add(event)

    def finish(self) -> None:
        """Puts complete synchronously: nothing outstanding."""

    def _notify_peers(self, reason: str) -> None:
        for r in range(self.world):
            if r != self.rank:
                self.heap.set_abort(r, self.rank + 1)

    def _peer_abort(self) -> str | None:
        if self._died is not None:
            return self._died
        code = self.heap.abort_code()
        return f"rank {code - 1} aborted the job" if code else None

    def _on_death(self, rank: int, pid: int) -> None:
        self._died = f"rank {rank} (pid {pid}) exited"

    def close(self) -> None:
        self._watch.stop()
        self._views, self._counters = [], []
        self.counters = None
        self.heap.close()


def _needs(step: Step, world: int) -> list[HeapNeed]:
    """Every rank's segment need for ``step``, computed identically on every rank."""
    tf, plan = step.region, step.plan
    events = np.diff(step.schedule.graph.event_ptr)
    out = []
    for r in range(world):
        shapes = tf.symmetric_shapes(plan, step.tiles, r)
        fields = tuple((name, *shapes[name]) for name in tf.symmetric)
        out.append(HeapNeed(events=int(events[r]), fields=fields))
    return out


class _PeerWatch:
    """A thread that calls ``on_death(rank, pid)`` when a peer process exits."""

    def __init__(self, pids: dict[int, int], on_death: Callable[[int, int], None]):
        self._poll = select.poll()
        self._fds: dict[int, tuple[int, int]] = {}
        for rank, pid in pids.items():
            fd = os.pidfd_open(pid)
            self._fds[fd] = (rank, pid)
            self._poll.register(fd, select.POLLIN)
        self._stop_r, self._stop_w = os.pipe()
        self._poll.register(self._stop_r, select.POLLIN)
        self._on_death = on_death
        self._thread = threading.Thread(target=self._loop, name="hpmoe-peer-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            for fd, _ in self._poll.poll():
                if fd == self._stop_r:
                    return
                self._poll.unregister(fd)
                self._on_death(*self._fds[fd])

    def stop(self) -> None:
        if self._stop_w < 0:
            return
        os.write(self._stop_w, b"x")
        if self._thread is not threading.current_thread():  # a session collected there
            self._thread.join(timeout=5.0)
        for fd in [*self._fds, self._stop_r, self._stop_w]:
            os.close(fd)
        self._stop_w = -1

"""``dist`` transport: puts over torch.distributed point-to-point (gloo here,
NCCL/HCCL elsewhere), for ranks on different hosts.

Receivers know from the plan every put addressed to them, so before the region
they post one ``irecv`` per put straight into the destination rows, and one per
header.  A sender issues its k-th put to a peer as the data (tag ``1 + seq``, where
``seq`` numbers the puts of the pair in task-id order) followed by an 8-byte header
carrying ``seq`` (tag ``HEADER_TAG + k``).  Gloo moves a pair's messages in the
order they were issued once their receives are posted — and every receive is
posted up front, so header k lands right after its data (a header receive posted
late would queue behind all outstanding data).  A progress thread per peer waits
on headers k = 0, 1, ... and turns each into its put's counter signals.  A header
of -1 means the peer aborted.  Counters are process-local futex words.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ...exec.program import PeerView, put_sequence
from ...ir.graph import IS_PUT
from ..counters import Counters
from ..executor import DaemonThread
from .base import Step, Transport, TransportKind

HEADER_TAG = 1 << 24  # header k of a pair has tag HEADER_TAG + k; data tags are 1 + seq < HEADER_TAG
ABORT = -1


@dataclass(frozen=True)
class Incoming:
    """Puts from one peer to this rank, by sequence number: destination field and
    rows, and this rank's events to signal when each lands."""

    field: tuple[str, ...]
    row0: tuple[int, ...]
    rows: tuple[int, ...]
    signals: tuple[tuple[int, ...], ...]


def senders(step: Step, rank: int) -> list[int]:
    """Ranks that put to ``rank`` in ``step``."""
    g = step.schedule.graph
    return np.unique(g.rank[IS_PUT[g.kind] & (g.peer == rank) & (g.rank != rank)]).tolist()


def incoming_from(step: Step, rank: int, src: int) -> Incoming:
    """The puts rank ``src`` makes to ``rank`` in ``step``, by sequence number."""
    g = step.schedule.graph
    ids = np.flatnonzero(IS_PUT[g.kind] & (g.peer == rank) & (g.rank == src))
    seq = put_sequence(g)
    ids = ids[np.argsort(seq[ids])]
    assert (seq[ids] == np.arange(len(ids))).all(), "put sequence numbers must be dense"
    ptr, ev, owner = g.sig_ptr, g.sig_event, g.sig_rank
    return Incoming(
        field=tuple(step.region.puts[int(k)].dst for k in g.kind[ids]),
        row0=tuple(g.dst_row0[ids].tolist()), rows=tuple((g.row1[ids] - g.row0[ids]).tolist()),
        signals=tuple(tuple(ev[ptr[i]:ptr[i + 1]][owner[ptr[i]:ptr[i + 1]] == rank].tolist()) for i in ids))


class _Latch:
    """Counts down to zero; ``wait`` returns whether it got there in time."""

    def __init__(self, n: int):
        self._n, self._cv = n, threading.Condition()

    def count_down(self) -> None:
        with self._cv:
            self._n -= 1
            self._cv.notify_all()

    def wait(self, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._n <= 0, timeout_s)


class DistTransport(Transport):
    """This rank's end of point-to-point puts within ``group`` (None: the world)."""

    kind = TransportKind.DIST

    def __init__(self, rank: int, world: int, group: dist.ProcessGroup | None, deadline_s: float):
        super().__init__(rank, world)
        self.group, self.deadline_s = group, deadline_s
        self.counters = Counters.anonymous(1024)
        self._pre = self.counters.snapshot()
        self._tensors: dict[str, torch.Tensor] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._threads: dict[int, DaemonThread] = {}
        self._latch = _Latch(0)
        self._headers_sent = [0] * world
        self._send_lock = threading.Lock()

    def _peer(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def begin(self) -> None:
        self._pre = self.counters.snapshot()

    def prepare(self, step: Step) -> dict[str, torch.Tensor]:
        n = step.program.num_events
        if n > self.counters.capacity:
            self.counters = Counters.anonymous(max(n, 2 * self.counters.capacity))
            self._pre = self.counters.snapshot()
        self.base = self._pre
        shapes = step.region.symmetric_shapes(step.plan, step.tiles, self.rank)
        self._tensors = {f: torch.empty(shapes[f][0], dtype=shapes[f][1], device="cpu")
                         for f in step.region.symmetric}
        peers = senders(step, self.rank)
        self._latch = _Latch(len(peers))
        self._headers_sent = [0] * self.world
        for s in peers:  # each peer's progress thread posts its receives as the region starts
            if s not in self._threads:
                self._threads[s] = DaemonThread(f"hpmoe-progress-{s}")
            self._threads[s].jobs.put(functools.partial(self._progress, step, s))
        return self._tensors

    def _post(self, s: int, inc: Incoming) -> tuple[list[dist.Work], torch.Tensor, list[dist.Work]]:
        """Post every receive from peer ``s``: (data works by seq, headers, header works),
        interleaved (data k, header k) — a late header receive posted after all data
        receives would be served after every pending data message."""
        n, src = len(inc.rows), self._peer(s)
        if n >= HEADER_TAG - 1:
            raise ValueError(f"{n} puts from rank {s} exceed the {HEADER_TAG - 2} tags of a pair")
        headers = torch.empty(n, dtype=torch.int64, device="cpu")
        data, posted = [], []
        for j, (f, r0, rows) in enumerate(zip(inc.field, inc.row0, inc.rows, strict=True)):
            data.append(dist.irecv(self._tensors[f][r0:r0 + rows], src=src, group=self.group, tag=1 + j))
            posted.append(dist.irecv(headers[j:j + 1], src=src, group=self.group, tag=HEADER_TAG + j))
        return data, headers, posted

    def _progress(self, step: Step, s: int) -> None:
        """Post the receives from peer ``s``, then turn its arrivals into counter
        signals, in arrival order (runs on the peer's progress thread)."""
        try:
            inc = incoming_from(step, self.rank, s)
            data, headers, posted = self._post(s, inc)
            for k in range(len(inc.rows)):
                posted[k].wait()
                j = int(headers[k])
                if j == ABORT:
                    self.fail_from_peer(f"rank {s} aborted the job")
                    return
                data[j].wait()
                for e in inc.signals[j]:
                    self.counters.add(e)
        except Exception as err:  # a dead or failing peer: stop this rank's waiters
            self.fail_from_peer(f"receiving from rank {s} failed: {type(err).__name__}: {err}")
        finally:
            self._latch.count_down()

    def put(self, dst_rank: int, dst: PeerView, src: torch.Tensor, signals: tuple[int, ...],
            seq: int) -> None:
        if dst_rank == self.rank:
            self._tensors[dst.field][dst.row0:dst.row0 + dst.rows].copy_(src)
            for e in signals:
                self.counters.add(e)
            return
        peer, src = self._peer(dst_rank), src.contiguous()
        header = torch.tensor([seq], dtype=torch.int64, device="cpu")
        with self._send_lock:  # data then header, header k in issue order
            k = self._headers_sent[dst_rank]
            self._headers_sent[dst_rank] = k + 1
            try:
                self._sends.append((dist.isend(src, dst=peer, group=self.group, tag=1 + seq), src))
                self._sends.append((dist.isend(header, dst=peer, group=self.group, tag=HEADER_TAG + k),
                                    header))
            except RuntimeError as err:  # e.g. a dead peer, found by this put before its receiver
                raise RuntimeError(f"sending to rank {dst_rank} failed: {err}") from err

    def finish(self) -> None:
        if not self._latch.wait(self.deadline_s):
            raise TimeoutError(f"puts to rank {self.rank} still missing after {self.deadline_s} s")
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait()

    def _notify_peers(self, reason: str) -> None:
        """Send each peer an abort as our next header (a peer that expects no more
        headers from us learns of the abort from its own deadline or failure)."""
        for r in range(self.world):
            if r == self.rank:
                continue
            header = torch.tensor([ABORT], dtype=torch.int64, device="cpu")
            with self._send_lock, contextlib.suppress(RuntimeError):  # the peer may be gone
                k = self._headers_sent[r]
                self._headers_sent[r] = k + 1
                self._sends.append((dist.isend(header, dst=self._peer(r), group=self.group,
                                               tag=HEADER_TAG + k), header))

    def close(self) -> None:
        threads, self._threads = list(self._threads.values()), {}
        for t in threads:
            t.jobs.put(None)
        for t in threads:  # a thread still waiting on a failed peer is a daemon: left behind
            t.join(0.1 if self.abort_reason() else 1.0)
        self._sends = []

"""The symmetric heap: one shared-memory segment per local rank, mapped by all.

Segment layout (bytes): a 64-byte control block (int32 abort word at 0: 0, or the
aborting rank + 1), then ``events`` int32 event counters, then the symmetric
tensors of the current region, each 64-byte aligned, in the order the region
lists them.  Sizes depend on the routing of each step: every rank computes every
rank's need from the plan, so all agree, without messages, on which segments must
grow; a grown segment is a new generation (new name), created by its owner,
under a fresh random name announced in an all-gather, mapped by everyone, then
unlinked by its owner after a second all-gather.
"""

from __future__ import annotations

import errno
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..counters import WORD, Counters
from .segment import (
    SHM_DIR,
    Segment,
    SegmentError,
    create_fresh,
    new_token,
    open_segment,
    segment_name,
    shm_free,
    size_text,
    unlink_segment,
)

CONTROL = 64
ALIGN = 64
MIN_DATA = 1 << 20
FieldShape = tuple[str, tuple[int, ...], torch.dtype]
_ROW = 3  # int64s per rank in the growth all-gather


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class HeapNeed:
    """What one rank's segment must hold for a region: ``events`` counters and the
    symmetric tensors ``fields`` (name, shape, dtype), in order."""

    events: int
    fields: tuple[FieldShape, ...]

    def offsets(self) -> list[int]:
        """Byte offset of each field within the data area."""
        out, at = [], 0
        for _, shape, dtype in self.fields:
            out.append(at)
            at = _align(at + math.prod(shape) * dtype.itemsize)
        return out

    @property
    def data_bytes(self) -> int:
        if not self.fields:
            return 0
        _, shape, dtype = self.fields[-1]
        return self.offsets()[-1] + math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class Capacity:
    """Counters and data bytes a segment generation was sized for."""

    events: int
    data_bytes: int

    @property
    def counter_bytes(self) -> int:
        return _align(self.events * WORD)

    @property
    def size(self) -> int:
        return CONTROL + self.counter_bytes + self.data_bytes

    def fits(self, need: HeapNeed) -> bool:
        return need.events <= self.events and need.data_bytes <= self.data_bytes

    def grown(self, need: HeapNeed) -> Capacity:
        """At least ``need``, and at least double what it was (amortised growth)."""
        return Capacity(events=max(need.events, 2 * self.events, 1024),
                        data_bytes=max(need.data_bytes, 2 * self.data_bytes, MIN_DATA))


@dataclass
class _Mapping:
    generation: int
    capacity: Capacity
    segment: Segment
    counters: Counters
    control: np.ndarray  # [16] int32 view of the control block


class SymmetricHeap:
    """Segments of the ``world`` local ranks of one job, seen from ``rank``.

    ``pids[r]`` is rank r's process (part of its segments' names).  ``all_gather``
    maps an int64 row [n] of this rank to every rank's [world, n] (a collective of
    all local ranks, under the session's deadline).  ``token`` draws the random part
    of each new segment name.
    """

    def __init__(self, job: str, rank: int, world: int, pids: list[int],
                 all_gather: Callable[[torch.Tensor], torch.Tensor], token: Callable[[], str] = new_token):
        self.job, self.rank, self.world, self.pids = job, rank, world, pids
        self._all_gather, self._token = all_gather, token
        self._maps: dict[int, _Mapping] = {}
        self._capacity = [Capacity(0, 0)] * world
        self._generation = [-1] * world
        self._created: set[str] = set()  # names this rank created and has not unlinked yet

    def ensure(self, needs: list[HeapNeed]) -> list[int]:
        """Grow the segments that cannot hold ``needs`` (one per rank); returns
        the ranks whose segment is new (its counters start at zero).  Collective when
        a segment grows: the owners create theirs under fresh names and every rank
        learns them (or every owner's failure) in one all-gather."""
        grow = [r for r in range(self.world) if not self._capacity[r].fits(needs[r])]
        if not grow:
            return []
        for r in grow:
            self._capacity[r] = self._capacity[r].grown(needs[r])
            self._generation[r] += 1
        mine = self._create() if self.rank in grow else torch.zeros(_ROW, dtype=torch.int64, device="cpu")
        table = self._all_gather(mine)
        self._check(table, grow)
        for r in grow:
            if r != self.rank:
                self._map(r, open_segment(self._name(r, table[r]), self._capacity[r].size))
        self._all_gather(torch.zeros(1, dtype=torch.int64, device="cpu"))  # everyone mapped them
        if self.rank in grow:
            self.unlink_created()
        return grow

    def _create(self) -> torch.Tensor:
        """This rank's row: (1, token) with its new segment mapped, or (-errno, size, free)."""
        size = self._capacity[self.rank].size
        try:
            seg, token = create_fresh(self.job, size, self._token)
        except SegmentError as err:
            return torch.tensor([-err.code, size, shm_free()], dtype=torch.int64, device="cpu")
        self._created.add(seg.name)
        self._map(self.rank, seg)
        return torch.tensor([1, int(token, 16) - 2**63, 0], dtype=torch.int64, device="cpu")

    def _check(self, table: torch.Tensor, grow: list[int]) -> None:
        """Raise ``SegmentError`` on every rank when any owner failed."""
        failed = [r for r in grow if int(table[r, 0]) != 1]
        if not failed:
            return
        self.unlink_created()
        code = -int(table[failed[0], 0])
        if code != errno.ENOSPC:
            raise SegmentError(code, f"rank {failed[0]} found every shared segment name it drew taken: "
                               f"someone creates hpmoe names in {SHM_DIR}")
        why = "; ".join(f"rank {r} could not create its {size_text(int(table[r, 1]))} shared segment, "
                        f"{size_text(int(table[r, 2]))} free" for r in failed)
        raise SegmentError(code, f"{SHM_DIR} is full: {why} (enlarge {SHM_DIR} or use transport=dist)")

    def _name(self, r: int, row: torch.Tensor) -> str:
        return segment_name(self.job, self.pids[r], f"{int(row[1]) + 2**63:016x}")

    def unlink_created(self) -> None:
        """Unlink every segment name this rank created and has not unlinked yet
        (mappings stay valid; safe in a signal handler)."""
        for name in list(self._created):
            unlink_segment(name)
            self._created.discard(name)

    def _map(self, r: int, seg: Segment) -> None:
        old = self._maps.pop(r, None)
        if old is not None:
            old.counters.release()
            old.segment.close()
        cap = self._capacity[r]
        self._maps[r] = _Mapping(generation=self._generation[r], capacity=cap, segment=seg,
                                 counters=Counters(seg.map, CONTROL, cap.events),
                                 control=np.frombuffer(seg.map, np.int32, CONTROL // 4, 0))

    def counters(self, r: int) -> Counters:
        return self._maps[r].counters

    def mapped(self, r: int) -> bool:
        return r in self._maps

    def tensors(self, r: int, need: HeapNeed) -> dict[str, torch.Tensor]:
        """Views of rank ``r``'s symmetric tensors laid out for ``need``."""
        m = self._maps[r]
        if not m.capacity.fits(need):
            raise ValueError(f"rank {r} segment holds {m.capacity}, region needs {need}")
        start = CONTROL + m.capacity.counter_bytes
        out = {}
        for (name, shape, dtype), off in zip(need.fields, need.offsets(), strict=True):
            count = math.prod(shape)
            flat = torch.frombuffer(m.segment.map, dtype=dtype, count=count, offset=start + off) \
                if count else torch.empty(0, dtype=dtype, device="cpu")
            out[name] = flat.view(shape)
        return out

    def set_abort(self, r: int, code: int) -> None:
        """Store ``code`` in rank ``r``'s abort word (if mapped)."""
        if r in self._maps:
            self._maps[r].control[0] = code

    def abort_code(self) -> int:
        """This rank's abort word: 0, or the rank + 1 that aborted the job."""
        m = self._maps.get(self.rank)
        return int(m.control[0]) if m is not None else 0

    def close(self) -> None:
        """Unlink every name this rank created and drop the mappings."""
        self.unlink_created()
        for m in self._maps.values():
            m.counters.release()
            m.segment.close()
        self._maps.clear()

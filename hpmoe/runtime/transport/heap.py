"""The symmetric heap: one shared-memory segment per local rank, mapped by all.

Segment layout (bytes): a 64-byte control block (int32 abort word at 0: 0, or the
aborting rank + 1), then ``events`` int32 event counters, then the symmetric
tensors of the current region, each 64-byte aligned, in the order the region
lists them.  Sizes depend on the routing of each step: every rank computes every
rank's need from the plan, so all agree, without messages, on which segments must
grow; a grown segment is a new generation (new name), created by its owner,
mapped by everyone between two barriers, then unlinked by its owner.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..counters import WORD, Counters
from .segment import Segment, create_segment, open_segment, segment_name, unlink_segment

CONTROL = 64
ALIGN = 64
MIN_DATA = 1 << 20
FieldShape = tuple[str, tuple[int, ...], torch.dtype]


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
    """Segments of the ``world`` local ranks of one session, seen from ``rank``.

    ``barrier`` synchronises all local ranks (a process-group barrier).
    """

    def __init__(self, job: str, session: str, rank: int, world: int, barrier: Callable[[], None]):
        self.job, self.session, self.rank, self.world = job, session, rank, world
        self._barrier = barrier
        self._maps: dict[int, _Mapping] = {}
        self._capacity = [Capacity(0, 0)] * world
        self._generation = [-1] * world

    def ensure(self, needs: list[HeapNeed]) -> list[int]:
        """Grow the segments that cannot hold ``needs`` (one per rank); returns
        the ranks whose segment is new (its counters start at zero)."""
        grow = [r for r in range(self.world) if not self._capacity[r].fits(needs[r])]
        if not grow:
            return []
        for r in grow:
            self._capacity[r] = self._capacity[r].grown(needs[r])
            self._generation[r] += 1
        if self.rank in grow:
            self._map(self.rank, create_segment(self._name(self.rank), self._capacity[self.rank].size))
        self._barrier()  # new segments exist
        for r in grow:
            if r != self.rank:
                self._map(r, open_segment(self._name(r), self._capacity[r].size))
        self._barrier()  # everyone mapped them
        if self.rank in grow:
            unlink_segment(self._name(self.rank))
        return grow

    def _name(self, r: int, generation: int | None = None) -> str:
        g = self._generation[r] if generation is None else generation
        return segment_name(self.job, self.session, r, g)

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
                if count else torch.empty(0, dtype=dtype)
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
        """Unlink every name this session may have created (any rank, any
        generation up to the current + 1) and drop the mappings."""
        for r in range(self.world):
            for g in range(self._generation[r] + 2):
                unlink_segment(self._name(r, g))
        for m in self._maps.values():
            m.counters.release()
            m.segment.close()
        self._maps.clear()

"""Event counters: int32 words that only ever grow (modulo 2**32).

A region waits on ``progress(i) = (counter[i] - base[i]) mod 2**32`` reaching the
event's threshold, where ``base`` is a snapshot taken before the region starts.
Counters are never reset: a fixed graph run for the n-th time waits on
``n * threshold + threshold``, i.e. thresholds are epoch-scaled by the snapshot,
and wrap-around is harmless while one region adds less than 2**31 to an event.
"""

from __future__ import annotations

import mmap

import numpy as np

from . import futex

MASK = 0xFFFFFFFF
WORD = 4  # bytes per counter


class Counters:
    """``capacity`` int32 counters at byte ``offset`` of a writable ``buffer``
    (an mmap of shared memory, or anonymous memory for process-local counters)."""

    def __init__(self, buffer: mmap.mmap | memoryview, offset: int, capacity: int):
        if offset % WORD:
            raise ValueError(f"Counters offset={offset} is not a multiple of {WORD}")
        self.capacity = capacity
        self._array = np.frombuffer(buffer, np.int32, capacity, offset)
        self.words = memoryview(self._array)  # indexing yields Python ints (raw values)
        self._addr = self._array.ctypes.data
        self._keep = buffer

    @staticmethod
    def anonymous(capacity: int) -> Counters:
        """Zeroed process-local counters."""
        return Counters(mmap.mmap(-1, max(capacity, 1) * WORD), 0, capacity)

    def value(self, i: int) -> int:
        """Raw signed value of counter ``i``."""
        return self.words[i]

    def progress(self, i: int, base: int) -> int:
        """Increments of counter ``i`` since ``base`` was read (mod 2**32)."""
        return (self.words[i] - base) & MASK

    def add(self, i: int, n: int = 1) -> None:
        """Atomically add ``n`` >= 1 to counter ``i`` and wake its waiters."""
        if not 0 <= i < self.capacity:
            raise IndexError(f"event {i} outside the {self.capacity} counters")
        while n > 0:
            step = min(n, futex.MAX_ADD)
            futex.add(self._addr + WORD * i, step)
            n -= step

    def signal(self, i: int, base: int, need: int) -> None:
        """Add 1 to counter ``i`` and wake its waiters only if that brings its progress
        since ``base`` to ``need``: a waiter of a many-signal event sleeps through the
        increments below its threshold instead of waking on each.  An add that will
        reach it adds and wakes in one call; one below adds quietly and wakes after all
        if another adder's add landed meanwhile.  No wake-up is lost: whoever adds last
        reads the reached value (or wakes with its add), and a sleeper that read an
        older value finds it changed in the kernel's compare."""
        if not 0 <= i < self.capacity:
            raise IndexError(f"event {i} outside the {self.capacity} counters")
        addr = self._addr + WORD * i
        if ((self.words[i] - base) & MASK) + 1 >= need:
            futex.add(addr, 1)
            return
        futex.add(addr, 1, wake=False)
        if (self.words[i] - base) & MASK >= need:
            futex.wake(addr)

    def sleep(self, i: int, observed: int, timeout_s: float) -> None:
        """Sleep while counter ``i`` still equals ``observed``, at most ``timeout_s``."""
        futex.wait(self._addr + WORD * i, observed, timeout_s)

    def snapshot(self, n: int | None = None) -> np.ndarray:
        """[n] int64 copy of the raw values of the first ``n`` counters (all by default)."""
        return self._array[: self.capacity if n is None else n].astype(np.int64)

    def release(self) -> None:
        """Drop the views into the buffer (so an mmap can be closed)."""
        self.words.release()
        self._array = np.zeros(0, np.int32)
        self._keep = None

"""Buffers reused across steps: a step's large intermediates come from an ``Arena``
instead of fresh allocations (a fresh multi-megabyte tensor is a fresh ``mmap``, and
every first touch of its pages is a page fault).

An arena serves one step at a time: a forward takes one from its ``ArenaPool`` and,
when activations are saved for backward, keeps it until the backward has run; a
second forward before that backward gets another arena.  Tensors that leave a step
(outputs, parameter gradients) never come from an arena.
"""

from __future__ import annotations

import math

import torch


class Arena:
    """Named flat buffers, grown on demand and reused by later ``take`` calls."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape`` tensor of ``dtype`` (uninitialised) backed by buffer
        ``name``; valid until the next ``take`` of the same name."""
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype)
            self._buffers[name] = buf
        return buf[:n].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class ArenaPool:
    """Arenas of one layer: ``acquire`` an idle one (or a new one), ``release`` it
    when its step no longer needs its buffers."""

    def __init__(self) -> None:
        self._idle: list[Arena] = []

    def acquire(self) -> Arena:
        return self._idle.pop() if self._idle else Arena()

    def release(self, arena: Arena) -> None:
        if all(a is not arena for a in self._idle):
            self._idle.append(arena)

    def __len__(self) -> int:
        return len(self._idle)

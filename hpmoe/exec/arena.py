"""Buffers reused across steps: a step's large intermediates come from an ``Arena``
instead of fresh allocations (a fresh multi-megabyte tensor is a fresh ``mmap``, and
every first touch of its pages is a page fault).

An arena serves one region call at a time: a forward or a backward takes one from its
``ArenaPool`` for its scratch and gives it back when it returns.  Tensors that leave a
call (outputs, activations saved for backward, parameter gradients) never come from a
pooled arena.  The pool also keeps what a layer holds resident across calls (the
persistent kernel's per-shape programs, each with its own device buffers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar, runtime_checkable

import torch

T = TypeVar("T")


@runtime_checkable
class Reports(Protocol):
    """What a layer keeps resident and checks one call late (a launch's late wait):
    ``report`` waits for the device and raises what is not reported yet."""

    def report(self) -> None: ...


class Arena:
    """Named flat buffers on ``device``, grown on demand and reused by later ``take`` calls."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape`` tensor of ``dtype`` (uninitialised) backed by buffer
        ``name``; valid until the next ``take`` of the same name."""
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:n].view(shape)

    def buffers(self) -> list[torch.Tensor]:
        """The flat buffers behind every name taken so far."""
        return list(self._buffers.values())

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class ArenaPool:
    """Arenas of one layer: ``acquire`` an idle one (or a new one), ``release`` it
    when its step no longer needs its buffers."""

    def __init__(self) -> None:
        self._idle: list[Arena] = []
        self._resident: dict[Hashable, object] = {}

    def resident(self, key: Hashable, build: Callable[[], T]) -> T:
        """What the layer keeps under ``key`` across calls, made by ``build`` on first use."""
        if key not in self._resident:
            self._resident[key] = build()
        return self._resident[key]  # type: ignore[return-value]

    def report(self) -> None:
        """Each resident's ``report`` (``Reports``), where it has one."""
        for kept in self._resident.values():
            if isinstance(kept, Reports):
                kept.report()

    def acquire(self, device: torch.device | str) -> Arena:
        """An idle arena on ``device``, or a new one."""
        device = torch.device(device)
        mine = [i for i, a in enumerate(self._idle) if a.device == device]
        return self._idle.pop(mine[-1]) if mine else Arena(device)

    def release(self, arena: Arena) -> None:
        if all(a is not arena for a in self._idle):
            self._idle.append(arena)

    def __len__(self) -> int:
        return len(self._idle)

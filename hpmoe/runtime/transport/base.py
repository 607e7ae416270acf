"""The transport interface: one-sided puts with a signal, event counters, abort.

Per region, a rank calls ``begin`` (before the token-count exchange: snapshot of
its counters), then ``prepare`` (after lowering: symmetric memory sized for this
region, receives posted), runs its workers — which call ``put`` and signal local
events on ``counters`` — and finally ``finish``.  ``abort`` tells every peer the
job is failing; ``abort_reason`` says whether this rank or a peer did.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from ...exec.program import PeerView, RankProgram
from ...ir.schedule import Schedule
from ...regions.base import Region
from ...routing import RoutingPlan
from ...spec import TileSpec
from ..counters import Counters


class TransportKind(enum.Enum):
    SHM = "shm"  # symmetric heap in POSIX shared memory: ranks on one host
    DIST = "dist"  # torch.distributed isend/irecv (gloo here): ranks on any hosts
    LOCAL = "local"  # one rank, no peers (EP=1, executor measurements)


@dataclass(frozen=True)
class Step:
    """Everything a transport may need about one region: ``schedule`` holds every
    rank's tasks (events of peers, puts addressed to this rank), ``program`` this
    rank's part."""

    region: Region
    plan: RoutingPlan
    tiles: TileSpec
    schedule: Schedule
    program: RankProgram


class Transport(ABC):
    """One rank's end of a transport.  Subclasses set ``counters`` in ``prepare``."""

    kind: TransportKind

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.counters: Counters | None = None
        self.base = np.zeros(0, np.int64)
        self._abort: str | None = None
        self._abort_lock = threading.Lock()

    @abstractmethod
    def begin(self) -> None:
        """Snapshot this rank's counters: no peer can signal this region's events
        before the token-count exchange that follows."""

    @abstractmethod
    def prepare(self, step: Step) -> dict[str, torch.Tensor]:
        """Size memory and counters for ``step``; set ``base`` ([events] int64 raw
        counter values before the region); return this rank's symmetric tensors."""

    @abstractmethod
    def put(self, dst_rank: int, dst: PeerView, src: torch.Tensor, signals: tuple[int, ...],
            seq: int) -> None:
        """Copy ``src`` ([dst.rows, ...] contiguous rows) into ``dst`` on ``dst_rank``,
        then add one to each of ``dst_rank``'s events ``signals``, data visible
        first.  ``seq`` is the put's index among this rank's puts to ``dst_rank``."""

    @abstractmethod
    def finish(self) -> None:
        """After the workers: complete outstanding sends and receives."""

    @abstractmethod
    def _notify_peers(self, reason: str) -> None:
        """Best effort: tell every peer that this rank aborts."""

    def _peer_abort(self) -> str | None:
        """A reason if a peer aborted or died (polled by waiting workers)."""
        return None

    def abort(self, reason: str) -> None:
        """Record ``reason`` (first one wins) and notify the peers once."""
        with self._abort_lock:
            if self._abort is not None:
                return
            self._abort = reason
        self._notify_peers(reason)

    def abort_reason(self) -> str | None:
        """Why this rank must stop, or None."""
        return self._abort or self._peer_abort()

    def fail_from_peer(self, reason: str) -> None:
        """Record an abort caused by a peer (no notification back)."""
        with self._abort_lock:
            if self._abort is None:
                self._abort = reason

    @abstractmethod
    def close(self) -> None:
        """Release every resource (idempotent)."""

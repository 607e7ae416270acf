"""``local`` transport: a single rank, no peers — puts are local copies.  For EP=1
and for measuring the executor alone."""

from __future__ import annotations

import torch

from ...exec.program import PeerView
from ..counters import Counters
from .base import Step, Transport, TransportKind


class LocalTransport(Transport):
    """Rank 0 of a world of one; counters are process-local."""

    kind = TransportKind.LOCAL

    def __init__(self, capacity: int = 1024):
        super().__init__(0, 1)
        self.counters = Counters.anonymous(capacity)
        self._pre = self.counters.snapshot()
        self._tensors: dict[str, torch.Tensor] = {}

    def begin(self) -> None:
        self._pre = self.counters.snapshot()

    def prepare(self, step: Step) -> dict[str, torch.Tensor]:
        return self.prepare_events(step.program.num_events) or self._symmetric(step)

    def prepare_events(self, events: int) -> dict[str, torch.Tensor]:
        """Size the counters for ``events`` and set ``base`` (no buffers)."""
        if events > self.counters.capacity:
            self.counters = Counters.anonymous(max(events, 2 * self.counters.capacity))
            self._pre = self.counters.snapshot()
        self.base = self._pre
        return {}

    def _symmetric(self, step: Step) -> dict[str, torch.Tensor]:
        shapes = step.region.symmetric_shapes(step.plan, step.tiles, 0)
        self._tensors = {f: torch.empty(shapes[f][0], dtype=shapes[f][1], device="cpu")
                         for f in step.region.symmetric}
        return self._tensors

    def put(self, dst_rank: int, dst: PeerView, src: torch.Tensor, signals: tuple[int, ...],
            seq: int) -> None:
        if dst_rank != 0:
            raise ValueError(f"local transport has no rank {dst_rank}")
        self._tensors[dst.field][dst.row0:dst.row0 + dst.rows].copy_(src)
        for e in signals:
            self.counters.add(e)

    def finish(self) -> None:
        """Nothing is outstanding."""

    def _notify_peers(self, reason: str) -> None:
        """No peers."""

    def close(self) -> None:
        self._tensors = {}

"""Deliberate faults, for testing that failures end in a diagnosis, not a hang."""

from __future__ import annotations

import enum
import itertools
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..exec.program import RankProgram
from ..ir.graph import PUT_KINDS
from ..regions.base import Kernel, Region


class FaultKind(enum.Enum):
    KILL = "kill"  # the rank SIGKILLs itself when it starts its `after`-th kernel
    SILENT = "silent"  # the rank's puts move no data and signal nothing
    UNREACHABLE = "unreachable"  # one event of the rank waits for one signal too many
    STALL = "stall"  # the rank stops itself (SIGSTOP) before the count exchange of region `after`


@dataclass(frozen=True)
class Fault:
    """A fault on rank ``rank``; ``after`` counts kernels (KILL) or names the region
    whose count exchange the rank never reaches (STALL, regions count from 1)."""

    kind: FaultKind
    rank: int
    after: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind):
            raise TypeError(f"Fault.kind must be a FaultKind, got {self.kind!r}")
        if self.rank < 0 or self.after < 0:
            raise ValueError(f"Fault.rank={self.rank} and Fault.after={self.after} must be >= 0")

    @staticmethod
    def parse(text: str) -> Fault:
        """``KIND:RANK[:AFTER]``, e.g. ``kill:1:5``."""
        parts = text.split(":")
        kinds = ", ".join(k.value for k in FaultKind)
        if len(parts) not in (2, 3) or parts[0] not in {k.value for k in FaultKind}:
            raise ValueError(f"--fault={text!r} must be KIND:RANK[:AFTER] with KIND one of {kinds}")
        if not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"--fault={text!r}: RANK and AFTER must be non-negative integers")
        return Fault(FaultKind(parts[0]), *(int(p) for p in parts[1:]))

    def before_exchange(self, rank: int, region: int) -> None:
        """STALL: stop this process (as SIGSTOP from outside would) on the faulty rank
        when region ``region`` reaches its count exchange."""
        if self.kind is FaultKind.STALL and rank == self.rank and region >= self.after:
            os.kill(os.getpid(), signal.SIGSTOP)

    def apply(self, program: RankProgram, region: Region) -> tuple[RankProgram, Region]:
        """(program, region) with the fault in, on the faulty rank only."""
        if program.rank != self.rank or self.kind is FaultKind.STALL:
            return program, region
        if self.kind is FaultKind.KILL:
            return program, replace(region, kernels=_killing(region.kernels, self.after))
        if self.kind is FaultKind.SILENT:
            silent = {**region.kernels, **{k: _nothing for k in PUT_KINDS}}
            return replace(program, put=[None] * program.num_tasks,
                           remote_signals=[()] * program.num_tasks), replace(region, kernels=silent, puts={})
        return _unreachable(program), region


def _nothing(*args: object) -> None:
    return None


def _killing(kernels: Mapping[int, Kernel], after: int) -> dict[int, Kernel]:
    calls = itertools.count()

    def wrap(fn: Kernel) -> Kernel:
        def kernel(*args: object) -> None:
            if next(calls) >= after:
                os.kill(os.getpid(), signal.SIGKILL)
            fn(*args)
        return kernel

    return {k: wrap(fn) for k, fn in kernels.items()}


def _unreachable(program: RankProgram) -> RankProgram:
    """Raise the threshold of the event the last waiting task waits on."""
    waiting = [i for i, ev in enumerate(program.wait) if ev >= 0]
    if not waiting:
        raise ValueError(f"rank {program.rank} has no task that waits: no threshold to raise")
    threshold = list(program.threshold)
    threshold[program.wait[waiting[-1]]] += 1
    return replace(program, threshold=threshold)

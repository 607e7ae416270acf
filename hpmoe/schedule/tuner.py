"""Tuning in step on every rank: the trial each call runs, the agreement's report of
its slowest-rank time, and the cache.

A call's trial stays open until the layer's next call (its backward, when it runs
before then, is timed into it); the next call's agreement carries every rank's time
of it, and every rank feeds the largest to the key's ``Tuning``.  So every rank holds
the same history (its digest is part of the agreement: ranks that diverged would stop
with a named mismatch), runs the same candidate at the same call and commits the same
winner, whatever its own clock said.  The first call of a key asks group rank 0's
cache (``TuneCache``) and shares the answer.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..comm import Collectives
from ..machine import Machine, machine
from .tune import Budget, Knobs, Space, TuneKey, TuneResult, Tuning
from .tune_cache import TuneCache

LOG = logging.getLogger("hpmoe.tune")


@dataclass
class Trial:
    """One call of a candidate: its number (the same on every rank), key, knobs, the
    seconds timed into it so far (forward, then backward) and whether it is timed at
    all (a settled key's calls are not: nothing waits for a device on them)."""

    id: int
    key: TuneKey
    knobs: Knobs
    seconds: float = 0.0
    tuning: bool = True


@contextmanager
def timed(trial: Trial | None, device: torch.device | None = None) -> Iterator[None]:
    """Add the block's wall seconds to ``trial`` (None or settled: nothing); on a CUDA
    ``device`` the block's kernels are waited for at both ends (they run asynchronously)."""
    if trial is not None and not trial.tuning:
        trial = None
    sync = trial is not None and device is not None and device.type == "cuda"
    if sync:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if trial is not None:
            if sync:
                torch.cuda.synchronize(device)
            trial.seconds += time.perf_counter() - t0


class OneProcess:
    """The collectives of a tuning in one process: rank 0 of one."""

    rank = 0

    def broadcast_bytes(self, data: bytes | None, what: str) -> bytes:
        return data


class Tuner:
    """One layer's tuning on this rank (every rank of the EP group holds one)."""

    def __init__(self, budget: Budget | None = None, write_cache: bool = True):
        self.budget = budget or Budget()
        self.write_cache = write_cache
        self.notes: list[str] = []
        self._keys: dict[TuneKey, Tuning] = {}
        self._open: Trial | None = None
        self._reported: Trial | None = None
        self._calls = 0
        self._machine: Machine | None = None
        self._digest: int | None = None

    @property
    def machine(self) -> Machine:
        if self._machine is None:
            self._machine = machine()
        return self._machine

    def key(self, *args: object) -> TuneKey:
        """``TuneKey.of(machine, *args)`` on this machine."""
        return TuneKey.of(self.machine.fingerprint(), *args)

    def report(self) -> tuple[int, int]:
        """Close the previous call's trial: (its number, its microseconds); (0, 0) when
        there is none or its key is settled."""
        trial, self._open = self._open, None
        if trial is None or self._keys[trial.key].result is not None:
            self._reported = None
            return 0, 0
        self._reported = trial
        return trial.id, max(0, round(trial.seconds * 1e6))

    def observe(self, ids: Sequence[int], micros: Sequence[int], rank: int) -> None:
        """Every rank's ``report`` from the agreement: the slowest rank's time goes to the
        trial's key (ranks report the same trial, being in step)."""
        trial, self._reported = self._reported, None
        if trial is None or set(ids) != {trial.id}:
            return
        tuning = self._keys[trial.key]
        tuning.observe(trial.knobs, max(micros) / 1e6)
        self._digest = None
        if tuning.result is not None:
            self._commit(trial.key, tuning.result, rank)

    def observe_own(self) -> None:
        """In one process: the previous call's own time is the slowest rank's."""
        trial, micros = self.report()
        self.observe([trial], [micros], 0)

    def digest(self) -> int:
        """31 bits of every key's history (equal on ranks in step); recomputed only when
        a time was observed or a key began, not on every call."""
        if self._digest is None:
            crc = 0
            for key in sorted(self._keys, key=repr):
                crc = zlib.crc32(f"{key!r}{self._keys[key].digest()}".encode(), crc)
            self._digest = crc >> 1
        return self._digest

    def start(self, key: TuneKey, space: Space, coll: Collectives, first: Knobs | None = None) -> Trial:
        """The trial of this call: the key's winner once settled, else its next
        candidate.  The first call of a key is collective (rank 0's cache lookup)."""
        if key not in self._keys:
            self._keys[key] = self._begin(key, space, coll, first)
            self._digest = None
        self._calls += 1
        tuning = self._keys[key]
        self._open = Trial(self._calls, key, tuning.next(), tuning=tuning.result is None)
        return self._open

    def knows(self, key: TuneKey) -> bool:
        """Whether a call of ``key`` has started (its tuning exists)."""
        return key in self._keys

    def result(self, key: TuneKey) -> TuneResult | None:
        tuning = self._keys.get(key)
        return tuning.result if tuning is not None else None

    def results(self) -> dict[TuneKey, TuneResult]:
        return {k: t.result for k, t in self._keys.items() if t.result is not None}

    def _begin(self, key: TuneKey, space: Space, coll: Collectives, first: Knobs | None) -> Tuning:
        cached = shared_lookup(key, coll, self.machine.versions(), self._note)
        return Tuning.committed(cached) if cached is not None else Tuning(space, self.budget, first)

    def _commit(self, key: TuneKey, result: TuneResult, rank: int) -> None:
        LOG.info("hpmoe tuned %s: %s", key, result.describe())
        if rank == 0 and self.write_cache:
            TuneCache().store(key, self.machine.versions(), result)

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            LOG.warning("hpmoe: %s", text)


def shared_lookup(key: TuneKey, coll: Collectives, versions: dict,
                  note: Callable[[str], None]) -> TuneResult | None:
    """Group rank 0's cache entry for ``key`` on every rank (collective); rank 0 passes a
    stale entry's explanation to ``note``."""
    found = None
    if coll.rank == 0:
        lookup = TuneCache().lookup(key, versions)
        if lookup.note:
            note(lookup.note)
        found = json.dumps(lookup.result.to_json() if lookup.result else None).encode()
    shared = json.loads(coll.broadcast_bytes(found, "tuning cache lookup"))
    return TuneResult.from_json(shared) if shared is not None else None

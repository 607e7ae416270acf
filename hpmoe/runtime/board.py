"""Status words: what each rank of a session is doing, kept in the job's key-value
store (the torch.distributed store every rank already reaches).

Each rank publishes one short status word ("forward region 4: count exchange")
with a heartbeat under ``<prefix>/status/<rank>``.  A background thread writes the
current word every ``beat_s``, and at once when a word is entered with ``publish``
(once per region: the agreement that opens it); entering costs the caller an
assignment, and a store that stops answering (the process hosting it is stopped)
never blocks the caller.  When a
collective misses its deadline, the waiting rank reads every peer's word to say who
did not arrive and what it was doing last.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

import torch.distributed as dist

BEAT_S = 0.5  # longest heartbeat period; a word older than 3 beats means the process is not running


@dataclass(frozen=True)
class Status:
    """seq: statuses the rank entered in this session (every rank enters the same
    sequence, so seqs compare across ranks).  since / beat: wall-clock seconds when
    the status was entered / last published."""

    seq: int
    text: str
    since: float
    beat: float

    def encode(self) -> str:
        return f"{self.seq}|{self.since:.3f}|{self.beat:.3f}|{self.text}"

    @staticmethod
    def decode(raw: bytes) -> Status:
        seq, since, beat, text = raw.decode(errors="replace").split("|", 3)
        return Status(int(seq), text, float(since), float(beat))

    def describe(self, now: float, beat_s: float = BEAT_S) -> str:
        """e.g. ``'forward region 3: run' for 2.1 s, no heartbeat for 2.0 s (stopped or hung)``."""
        out = f"'{self.text}' for {max(0.0, now - self.since):.1f} s"
        silent = now - self.beat
        if silent > 3 * beat_s:
            out += f", no heartbeat for {silent:.1f} s (stopped or hung)"
        return out


class Board:
    """This rank's status word in ``store`` under ``prefix``, and a reader of every
    rank's (``world`` ranks)."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, world: int, beat_s: float = BEAT_S):
        self.store, self.prefix, self.rank, self.world = store, prefix, rank, world
        self.beat_s = beat_s
        now = time.time()
        self._status = Status(0, "session started", now, now)
        self._dirty, self._stop = True, False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._publish, name="hpmoe-board", daemon=True)
        self._thread.start()

    def key(self, rank: int) -> str:
        return f"{self.prefix}/status/{rank}"

    def enter(self, text: str, publish: bool = True) -> Status:
        """Make ``text`` this rank's status; ``publish``: write it now (in the
        background), else with the next heartbeat."""
        now = time.time()
        self._status = Status(self._status.seq + 1, text, now, now)
        if publish:
            with self._cond:
                self._dirty = True
                self._cond.notify()
        return self._status

    @property
    def status(self) -> Status:
        return self._status

    def _publish(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._dirty or self._stop, self.beat_s)
                if self._stop:
                    return
                status, self._dirty = replace(self._status, beat=time.time()), False
            try:
                self.store.set(self.key(self.rank), status.encode())
            except Exception:  # the store is gone or unreachable: the reader says so
                time.sleep(self.beat_s)

    def read(self, timeout_s: float = 1.0) -> dict[int, Status | None] | None:
        """Every rank's last published status (None: never published); None when the
        store does not answer within ``timeout_s``."""
        box: list = []

        def fetch() -> None:
            out: dict[int, Status | None] = {}
            for r in range(self.world):
                key = self.key(r)
                out[r] = Status.decode(self.store.get(key)) if self.store.check([key]) else None
            box.append(out)

        t = threading.Thread(target=fetch, name="hpmoe-board-read", daemon=True)
        t.start()
        t.join(timeout_s)
        return box[0] if box else None

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not threading.current_thread():  # a session collected there
            self._thread.join(timeout=1.0)

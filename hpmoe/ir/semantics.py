"""The IR's synchronisation rule, interpreted once: ``EventCounts`` is the reference
every clock is checked against.

A task waits on at most one event until its counter reaches the event's threshold,
runs, then adds one to every event of its signal list.  The exact executor
(``exec.exact.run_graph``) runs tasks under ``EventCounts`` one at a time; every other
interpreter of the rule — the runtime's worker threads, the GPU kernel's packed arrays,
the simulator's replay — produces a trace of when each task started and ended, and
``check_trace`` replays that trace under the same ``EventCounts``
(tests/test_event_semantics.py)."""

from __future__ import annotations

import enum

import numpy as np

from .analysis import GraphError
from .graph import IS_PUT, TaskGraph


class Signals(enum.Enum):
    """When a trace's tasks signal: all at their end (the simulator, the device), or a
    put's signals of its peer (itself included) while it runs, the rest at its end (the
    runtime: a put bumps the peer's counters when its rows land, inside the call)."""

    AT_END = "at-end"
    PUTS_LAND_DURING = "puts-land-during"


class EventCounts:
    """Every rank's event counters of ``graph`` (global event ids), from zero."""

    def __init__(self, graph: TaskGraph):
        self.graph = graph
        self.wait = graph.wait_global().tolist()
        self.threshold = graph.threshold.tolist()
        self.ptr = graph.sig_ptr.tolist()
        self.signals = graph.signals_global().tolist()
        task = graph.signaller()
        lands = IS_PUT[graph.kind][task] & (graph.sig_rank == graph.peer[task])
        self.lands = lands.tolist()  # a put's signal of its peer: when its rows land
        self.count = [0] * graph.num_events

    def start(self, task: int) -> None:
        """Raise ``GraphError`` unless ``task``'s event reached its threshold."""
        ev = self.wait[task]
        if ev >= 0 and self.count[ev] < self.threshold[ev]:
            g = self.graph
            rank = int(g.rank[task])
            local = ev - int(g.event_ptr[rank])
            raise GraphError(f"{g.task(task)} starts before its event {g.event_name(rank, local)} "
                             f"reached {self.threshold[ev]} (at {self.count[ev]})")

    def signal(self, task: int, lands: bool | None = None) -> None:
        """Add one to each event ``task`` signals (only a put's signals of its peer, or
        only the others, when ``lands`` says which)."""
        for s in range(self.ptr[task], self.ptr[task + 1]):
            if lands is None or self.lands[s] is lands:
                self.count[self.signals[s]] += 1


_END, _LANDS, _START = 0, 1, 2  # at one instant: ends signal before a start is checked


def check_trace(graph: TaskGraph, start: np.ndarray, end: np.ndarray,
                signals: Signals = Signals.AT_END) -> None:
    """Replay a clock's trace — ``start`` and ``end`` [n] of every task of ``graph``, in
    any one time base — under ``EventCounts``; raise ``GraphError`` naming the first
    task that started before its event reached its threshold, or ``ValueError`` when
    the trace does not hold every task once."""
    start, end = np.asarray(start, np.float64), np.asarray(end, np.float64)
    n = graph.num_tasks
    if start.shape != (n,) or end.shape != (n,) or not (np.isfinite(start).all() and np.isfinite(end).all()):
        raise ValueError(f"a trace holds a finite start and end for each of the {n} tasks, "
                         f"got shapes {start.shape}, {end.shape}")
    if (end < start).any():
        raise ValueError(f"task {int(np.argmax(end < start))} ends before it starts")
    during = signals is Signals.PUTS_LAND_DURING
    points = [(t, _END, i) for i, t in enumerate(end.tolist())]
    points += [(t, _START, i) for i, t in enumerate(start.tolist())]
    points += [(t, _LANDS, i) for i, t in enumerate(start.tolist())] if during else []
    counts = EventCounts(graph)
    for _, phase, i in sorted(points):
        if phase == _START:
            counts.start(i)
        else:
            counts.signal(i, (phase == _LANDS) if during else None)

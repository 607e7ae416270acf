"""Static checks of task graphs: every waited event reaches its threshold and the
wait/signal relation has no cycle.  A failure names the tasks and events involved.

The check runs the graph "infinitely wide": level by level, every task whose event
has reached its threshold completes and signals.  Tasks that never run are then
explained: either their event cannot collect enough signals (unreachable
threshold) or they wait, through a chain of unfinished signallers, on themselves
(a cycle).  ``random_order`` draws one valid order, or raises the check's diagnosis
when none exists.
"""

from __future__ import annotations

import os

import numpy as np

from .analysis import GraphError, completion_levels, ready_at_start, waiters
from .graph import TaskGraph

DEBUG_ENV = "HPMOE_DEBUG"  # "1": verify the graph and schedule of every compiled region


def debug_enabled() -> bool:
    """Whether ``HPMOE_DEBUG=1`` asks every compile to verify what it builds."""
    return os.environ.get(DEBUG_ENV, "") == "1"


def verify_graph(graph: TaskGraph) -> None:
    """Raise ``GraphError`` unless every task of ``graph`` can run to completion.

    Needs a graph holding every rank's tasks (remote signals must be present)."""
    if len(graph.ranks) != graph.ep:
        raise GraphError(f"verify_graph needs all {graph.ep} ranks, graph has ranks {graph.ranks}")
    check_deadlock(graph, graph.wait_global(), graph.sig_ptr, graph.signals_global(), graph.threshold)


def check_deadlock(graph: TaskGraph, wait: np.ndarray, sig_ptr: np.ndarray, signals: np.ndarray,
                   threshold: np.ndarray) -> None:
    """Shared by graph and schedule verification: ``wait``/``signals`` may include
    the extra queue-order dependencies a schedule adds."""
    level = completion_levels(wait, threshold, sig_ptr, signals)
    stuck = np.flatnonzero(level < 0)
    if not stuck.size:
        return
    total = np.bincount(signals, minlength=len(threshold))
    short = np.unique(wait[stuck][total[wait[stuck]] < threshold[wait[stuck]]])
    if short.size:
        raise GraphError(_unreachable_message(graph, short, total, threshold, wait))
    raise GraphError("dependency cycle: " + " -> ".join(
        _event_name(graph, e, threshold) if kind == "event" else graph.task(e)
        for kind, e in _find_cycle(stuck, wait, level, sig_ptr, signals)))


def _event_name(graph: TaskGraph, ev: int, threshold: np.ndarray) -> str:
    if ev >= graph.num_events:
        return f"queue-order event {ev} (threshold {threshold[ev]})"
    rank = int(np.searchsorted(graph.event_ptr, ev, side="right") - 1)
    return f"event r{rank}:{ev - graph.event_ptr[rank]} (threshold {threshold[ev]})"


def _unreachable_message(graph: TaskGraph, events: np.ndarray, total: np.ndarray,
                         threshold: np.ndarray, wait: np.ndarray) -> str:
    lines = []
    for ev in events[:5]:
        waiting = np.flatnonzero(wait == ev)[:3]
        lines.append(f"{_event_name(graph, int(ev), threshold)} can only reach {total[ev]}; "
                     f"waiting: " + "; ".join(graph.task(int(t)) if t < graph.num_tasks else f"task {t}"
                                              for t in waiting))
    more = f" (+{len(events) - 5} more events)" if len(events) > 5 else ""
    return "unreachable threshold: " + " | ".join(lines) + more


def _find_cycle(stuck: np.ndarray, wait: np.ndarray, level: np.ndarray, sig_ptr: np.ndarray,
                signals: np.ndarray) -> list[tuple[str, int]]:
    """Follow 'waits on an event signalled by an unfinished task' until a repeat."""
    producers: dict[int, int] = {}
    for t in stuck:
        for ev in signals[sig_ptr[t]:sig_ptr[t + 1]]:
            producers.setdefault(int(ev), int(t))
    path: list[tuple[str, int]] = []
    seen: dict[int, int] = {}
    t = int(stuck[0])
    while t not in seen:
        seen[t] = len(path)
        path.append(("task", t))
        ev = int(wait[t])
        path.append(("event", ev))
        t = producers[ev]
    return path[seen[t]:] + [("task", t)]


def random_order(graph: TaskGraph, seed: int) -> np.ndarray:
    """A uniformly shuffled valid execution order (one task at a time)."""
    rng = np.random.default_rng(seed)
    wait, signals = graph.wait_global(), graph.signals_global()
    w = waiters(wait, graph.num_events)
    count = np.zeros(graph.num_events, np.int64)
    ready = list(np.flatnonzero(ready_at_start(wait, graph.threshold)))
    order = []
    while ready:
        j = int(rng.integers(len(ready)))
        ready[j], ready[-1] = ready[-1], ready[j]
        t = ready.pop()
        order.append(t)
        for ev in signals[graph.sig_ptr[t]:graph.sig_ptr[t + 1]]:
            count[ev] += 1
            if count[ev] == graph.threshold[ev]:
                ready.extend(w.task[w.ptr[ev]:w.ptr[ev + 1]])
    if len(order) != graph.num_tasks:
        verify_graph(graph)  # raises GraphError naming the cause
    return np.asarray(order, np.int64)

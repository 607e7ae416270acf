"""Analyses of a task graph's wait/signal semantics, shared by every stage that
reasons about completion without a clock: who waits on which event, the level at
which each task can complete on unlimited workers, and random valid orders.
(The simulator replays the same semantics on its own clock.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .graph import TaskGraph


class GraphError(ValueError):
    """A task graph or schedule that cannot complete; the message names the culprits."""


@dataclass(frozen=True)
class Waiters:
    """CSR from global event id to the tasks waiting on it."""

    ptr: np.ndarray
    task: np.ndarray


def waiters(wait_global: np.ndarray, num_events: int) -> Waiters:
    has = np.flatnonzero(wait_global >= 0)
    ev = wait_global[has]
    order = np.argsort(ev, kind="stable")
    ptr = np.zeros(num_events + 1, np.int64)
    np.cumsum(np.bincount(ev, minlength=num_events), out=ptr[1:])
    return Waiters(ptr=ptr, task=has[order])


def gather_csr(ptr: np.ndarray, values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Concatenation of ``values[ptr[r]:ptr[r+1]]`` for every r in ``rows``."""
    lo, hi = ptr[rows], ptr[rows + 1]
    n = hi - lo
    idx = np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
    return values[idx]


def completion_levels(wait: np.ndarray, threshold: np.ndarray, sig_ptr: np.ndarray,
                      signals: np.ndarray) -> np.ndarray:
    """Level at which each task can complete when workers are unlimited; -1 = never.

    wait: [n] global event ids (-1: none); signals: global event ids, CSR by sig_ptr.
    """
    n = len(wait)
    w = waiters(wait, len(threshold))
    level = np.full(n, -1, np.int64)
    count = np.zeros(len(threshold), np.int64)
    ready = np.flatnonzero(ready_at_start(wait, threshold))
    depth = 0
    while ready.size:
        level[ready] = depth
        ev = gather_csr(sig_ptr, signals, ready)
        before = count.copy()
        np.add.at(count, ev, 1)
        fired = np.unique(ev[(before[ev] < threshold[ev]) & (count[ev] >= threshold[ev])])
        ready = gather_csr(w.ptr, w.task, fired)
        ready = ready[level[ready] < 0]
        depth += 1
    return level


def ready_at_start(wait: np.ndarray, threshold: np.ndarray) -> np.ndarray:
    """[n] bool: tasks that wait on nothing or on an event of threshold 0."""
    ready = wait < 0
    ready[~ready] = threshold[wait[~ready]] <= 0
    return ready


def initially_ready(graph: TaskGraph) -> np.ndarray:
    """[n] bool: the task waits on nothing, or on an event of threshold 0."""
    return ready_at_start(graph.wait_global(), graph.threshold)


def task_levels(graph: TaskGraph) -> np.ndarray:
    """[n] completion level of each task in the infinitely wide execution of ``graph``
    (``completion_levels``); ``GraphError`` when some task never runs."""
    level = completion_levels(graph.wait_global(), graph.threshold, graph.sig_ptr, graph.signals_global())
    if (level < 0).any():
        raise GraphError(f"{graph.task(int(np.flatnonzero(level < 0)[0]))} can never run; "
                         "run hpmoe.ir.verify.verify_graph for the cause")
    return level


def level_groups(graph: TaskGraph) -> list[np.ndarray]:
    """Task ids per completion level, first level first."""
    level = task_levels(graph)
    order = np.argsort(level, kind="stable")
    cuts = np.searchsorted(level[order], np.arange(1, int(level.max(initial=-1)) + 1))
    return np.split(order, cuts) if len(order) else []


def exact_events(graph: TaskGraph) -> np.ndarray:
    """[events + 1] bool: the event needs every one of its signals (threshold == signal
    count); chains are only followed through these, so the levels stay lower bounds.
    The last entry (False) stands for "no event" (wait id -1)."""
    total = np.bincount(graph.signals_global(), minlength=graph.num_events)
    return np.append(graph.threshold == total, False)


def top_levels(graph: TaskGraph, duration: np.ndarray) -> np.ndarray:
    """[n] seconds: earliest start of each task with unlimited workers and no ports."""
    wait, signals, exact = graph.wait_global(), graph.signals_global(), exact_events(graph)
    fire = np.zeros(graph.num_events + 1)  # the last entry: "no event", stays 0
    top = np.zeros(graph.num_tasks)
    for t in level_groups(graph):
        top[t] = fire[wait[t]]
        ev = gather_csr(graph.sig_ptr, signals, t)
        finish = np.repeat(top[t] + duration[t], graph.sig_ptr[t + 1] - graph.sig_ptr[t])
        np.maximum.at(fire, ev[exact[ev]], finish[exact[ev]])
    return top


def bottom_levels(graph: TaskGraph, duration: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
    """[n] seconds: duration + max(longest chain of any successor, ``extra``), i.e. the
    longest chain from each task's start to the end of the graph."""
    wait, signals, exact = graph.wait_global(), graph.signals_global(), exact_events(graph)
    extra = np.zeros(graph.num_tasks) if extra is None else extra
    best = np.zeros(graph.num_events + 1)  # longest chain among each event's waiters
    b = np.zeros(graph.num_tasks)
    for t in reversed(level_groups(graph)):
        counts = graph.sig_ptr[t + 1] - graph.sig_ptr[t]
        succ = np.zeros(len(t))
        np.maximum.at(succ, np.repeat(np.arange(len(t)), counts), best[gather_csr(graph.sig_ptr, signals, t)])
        b[t] = duration[t] + np.maximum(succ, extra[t])
        w = wait[t]
        keep = exact[w]
        np.maximum.at(best, w[keep], b[t][keep])
    return b

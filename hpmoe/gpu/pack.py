"""Packing: a compiled region (a ``Schedule`` over every rank) into flat int32 arrays.

``pack(schedule, space)`` is a pure function: the same schedule and buffer space give
the same arrays.  What the device reads, per task t of the schedule's graph:

  tasks[t, :]        operand row (``ops.COLUMNS``): kind, op, shapes, buffers;
  wait_event[t]      global id of the event t waits on (-1: none);
  wait_threshold[t]  that event's threshold (every call starts the counters from zero);
  sig_ptr / sig_event  CSR of the global events t signals (release-add 1 each);
  queue_ptr / queue_task  CSR of every worker queue's tasks in order (queue q =
                     program q of the persistent kernel).

Every rank's events live in one counter array (global ids ``event_ptr[rank] + local``):
a put signals its peer's event exactly as a local task signals its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .buffers import BufferSpace
from .core import Schedule, TaskGraph, deprecated
from .ops import NCOL, describe

INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True)
class PackedProgram:
    """The device arrays of one region (all int32) and what the host needs to read
    results back: the graph, the buffer space, each queue's name, and the schedule
    (None for a program packed from a task list by ``pack_tasks``)."""

    graph: TaskGraph
    space: BufferSpace
    queue_names: tuple[str, ...]
    schedule: Schedule | None
    tasks: np.ndarray  # [n, NCOL]
    wait_event: np.ndarray  # [n]
    wait_threshold: np.ndarray  # [n]
    sig_ptr: np.ndarray  # [n + 1]
    sig_event: np.ndarray  # [num signals]
    queue_ptr: np.ndarray  # [queues + 1]
    queue_task: np.ndarray  # [n]

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def num_queues(self) -> int:
        return len(self.queue_ptr) - 1

    @property
    def num_events(self) -> int:
        return self.graph.num_events

    @property
    def wait_step(self) -> np.ndarray:
        """Deprecated: the signals each task's waited event receives per call (calls kept
        their counters then)."""
        deprecated("PackedProgram.wait_step", "every call starts its counters from zero: a wait reads "
                   "wait_threshold alone")
        step = np.bincount(self.sig_event, minlength=max(self.num_events, 1))
        return np.where(self.wait_event >= 0, step[np.maximum(self.wait_event, 0)], 0).astype(np.int32)

    def max_calls(self) -> int:
        """Deprecated: calls before a counter would overflow int32, unbounded now."""
        deprecated("PackedProgram.max_calls()", "every call starts its counters from zero, so no number "
                   "of calls overflows them")
        return INT32_MAX

    def arrays(self) -> dict[str, np.ndarray]:
        """The device arrays by name, in the order the kernel takes them."""
        return {n: getattr(self, n) for n in ("tasks", "wait_event", "wait_threshold", "sig_ptr", "sig_event",
                                              "queue_ptr", "queue_task")}


def pack(schedule: Schedule, space: BufferSpace, tasks: np.ndarray | None = None) -> PackedProgram:
    """Flatten ``schedule`` (every rank of its region) into device arrays; ``tasks``: the
    graph's operand rows when the caller has them (``describe``)."""
    g = schedule.graph
    if g.ranks != tuple(range(g.ep)):
        raise ValueError(f"pack needs the graph of every rank of the EP group, got ranks {g.ranks}")
    if space.ep != g.ep:
        raise ValueError(f"buffer space is for ep={space.ep}, the graph for ep={g.ep}")
    wait = g.wait_global()
    signals = g.signals_global()
    has = wait >= 0
    safe = np.where(has, wait, 0)
    arrays = {
        "tasks": describe(g, space) if tasks is None else tasks, "wait_event": wait,
        "wait_threshold": np.where(has, g.threshold[safe] if g.num_events else 0, 0),
        "sig_ptr": g.sig_ptr, "sig_event": signals,
        "queue_ptr": schedule.queue_ptr, "queue_task": schedule.queue_task}
    names = tuple(schedule.describe_queue(q) for q in range(schedule.num_queues))
    return PackedProgram(graph=g, space=space, queue_names=names, schedule=schedule,
                         **{n: _int32(n, a) for n, a in arrays.items()})


def pack_tasks(graph: TaskGraph, space: BufferSpace, ids: np.ndarray, queues: int) -> PackedProgram:
    """The tasks ``ids`` of ``graph`` dealt round-robin to ``queues`` queues, without
    waits or signals: one tile function on a task table of its own (tests), or one
    phase of a region at a time (the phase-by-phase benchmark)."""
    ids = np.asarray(ids, np.int64)
    if not isinstance(queues, int) or queues <= 0:
        raise ValueError(f"queues must be a positive int, got {queues!r}")
    owner = np.arange(len(ids)) % queues
    order = np.argsort(owner, kind="stable")
    ptr = np.zeros(queues + 1, np.int64)
    np.cumsum(np.bincount(owner, minlength=queues), out=ptr[1:])
    n = graph.num_tasks
    arrays = {"tasks": describe(graph, space), "wait_event": np.full(n, -1), "wait_threshold": np.zeros(n),
              "sig_ptr": np.zeros(n + 1), "sig_event": np.zeros(0),
              "queue_ptr": ptr, "queue_task": ids[order]}
    return PackedProgram(graph=graph, space=space, queue_names=tuple(f"queue {q}" for q in range(queues)),
                         schedule=None, **{k: _int32(k, a) for k, a in arrays.items()})


def _int32(name: str, a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.size and (a.max() > INT32_MAX or a.min() < -INT32_MAX):
        raise ValueError(f"{name} holds {a.max()} (or {a.min()}), outside int32: the region is too large "
                         "for one packed program")
    out = np.ascontiguousarray(a, dtype=np.int32)
    return out.reshape(-1, NCOL) if name == "tasks" else out

"""Static proof that a ``Schedule`` cannot deadlock.

A worker runs its queue in order, so a task waits on two things: its event and the
task before it in its queue.  Plan of ``verify_schedule``:
  1. the queues are a partition of the tasks onto workers of the right rank and unit;
  2. the graph alone completes (every threshold reachable, no cycle);
  3. each queue-order dependency becomes an extra event (ids after the graph's): the
     task waits on a fresh event signalled by its queue predecessor and, unless the
     predecessor's completion or the original event already implies the other, by
     every signaller of the original event too (then the extra event needs all of
     them: exact when thresholds equal signal counts, as every lowering makes them);
  4. ``hpmoe.ir.verify.check_deadlock`` runs the extended graph; a cycle is reported with
     its tasks, and every queue-order event in it is named by its queue.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .analysis import GraphError, gather_csr
from .graph import TaskGraph, Unit
from .schedule import Schedule, queue_id
from .verify import check_deadlock


@dataclass(frozen=True)
class QueueOrderGraph:
    """The graph's dependencies plus the queue-order ones, in global event ids.

    wait: [n]; sig_ptr: [n + 1]; signals: CSR by sig_ptr; threshold: [events];
    gated: [extra events] the task each extra event (id ``num_events + j``) gates.
    """

    wait: np.ndarray
    sig_ptr: np.ndarray
    signals: np.ndarray
    threshold: np.ndarray
    gated: np.ndarray


def verify_schedule(schedule: Schedule) -> None:
    """Raise ``GraphError`` naming the cycle (or unreachable threshold) unless every
    queue of ``schedule`` runs to its end; ``ValueError`` for a malformed schedule."""
    check_structure(schedule)
    g = schedule.graph
    check_deadlock(g, g.wait_global(), g.sig_ptr, g.signals_global(), g.threshold)
    ext = queue_order_graph(schedule)
    if not len(ext.threshold):
        return
    try:
        check_deadlock(g, ext.wait, ext.sig_ptr, ext.signals, ext.threshold)
    except GraphError as err:
        raise GraphError(f"{err}. {_legend(schedule, ext, str(err))}") from None


def require_all_ranks(graph: TaskGraph) -> None:
    """Schedulers and the simulator see every rank at once (puts reach real peers)."""
    if len(graph.ranks) != graph.ep:
        raise ValueError(f"graph.ranks={graph.ranks}: scheduling needs the graph of all {graph.ep} ranks")


def check_structure(schedule: Schedule) -> None:
    """Every task sits in exactly one queue, the one of its rank, unit and worker."""
    g, w = schedule.graph, schedule.workers
    n = g.num_tasks
    if len(schedule.queue_ptr) != g.ep * w.per_rank + 1:
        raise ValueError(f"queue_ptr has {len(schedule.queue_ptr)} entries, expected "
                         f"{g.ep * w.per_rank + 1}")
    if len(schedule.worker) != n or len(schedule.queue) != n:
        raise ValueError(f"worker/queue have {len(schedule.worker)}/{len(schedule.queue)} entries, "
                         f"expected {n}")
    if not np.array_equal(np.sort(schedule.queue_task), np.arange(n)):
        raise ValueError("queue_task is not a permutation of the task ids")
    limit = np.where(g.unit == Unit.MATRIX, w.matrix, w.vector)
    bad = np.flatnonzero((schedule.worker < 0) | (schedule.worker >= limit)
                         | (schedule.queue != queue_id(w, g.rank, g.unit, schedule.worker)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{g.task(i)}: worker={schedule.worker[i]} queue={schedule.queue[i]} "
                         f"do not match its rank and unit")
    placed = np.repeat(np.arange(schedule.num_queues), np.diff(schedule.queue_ptr))
    wrong = np.flatnonzero(schedule.queue[schedule.queue_task] != placed)
    if wrong.size:
        i = int(schedule.queue_task[wrong[0]])
        raise ValueError(f"{g.task(i)} listed in queue {placed[wrong[0]]}, assigned to queue "
                         f"{schedule.queue[i]}")


def queue_predecessor(schedule: Schedule) -> np.ndarray:
    """[n] the task before each task in its queue, -1 for the first of a queue."""
    qt = schedule.queue_task
    pred = np.full(len(qt), -1, np.int64)
    first = np.zeros(len(qt), bool)
    first[schedule.queue_ptr[:-1][np.diff(schedule.queue_ptr) > 0]] = True
    prev = np.concatenate([[-1], qt[:-1]])
    pred[qt] = np.where(first, -1, prev)
    return pred


def queue_order_graph(schedule: Schedule) -> QueueOrderGraph:
    """Extend the graph's waits and signals with the queue-order dependencies."""
    g = schedule.graph
    wait, signals = g.wait_global(), g.signals_global()
    pred = queue_predecessor(schedule)
    total = np.bincount(signals, minlength=g.num_events)
    only_pred = (pred >= 0) & ((wait < 0) | (wait == np.where(pred >= 0, wait[pred], -2)))
    both = (pred >= 0) & ~only_pred & ~_implied_by_event(g, pred, wait, total)
    gated = np.flatnonzero(only_pred | both)
    new_event = g.num_events + np.arange(len(gated))
    src_tasks, src_events = _gate_signals(g, pred, wait, gated, new_event, both)
    new_wait = wait.copy()
    new_wait[gated] = new_event
    thr = np.where(both[gated], np.append(total, 0)[wait[gated]] + 1, 1)
    task = np.concatenate([g.signaller(), src_tasks])
    ev = np.concatenate([signals, src_events])
    order = np.argsort(task, kind="stable")
    ptr = np.zeros(g.num_tasks + 1, np.int64)
    np.cumsum(np.bincount(task, minlength=g.num_tasks), out=ptr[1:])
    return QueueOrderGraph(wait=new_wait, sig_ptr=ptr, signals=ev[order],
                           threshold=np.concatenate([g.threshold, thr]), gated=gated)


def _implied_by_event(g: TaskGraph, pred: np.ndarray, wait: np.ndarray, total: np.ndarray) -> np.ndarray:
    """[n] the predecessor signals the task's event and the event needs every signal,
    so the event firing implies the predecessor ended."""
    ok = (pred >= 0) & (wait >= 0)
    if not g.num_events:
        return ok
    ok &= g.threshold[np.maximum(wait, 0)] == total[np.maximum(wait, 0)]
    pairs = np.unique(g.signaller() * max(g.num_events, 1) + g.signals_global())
    query = np.where(ok, pred * max(g.num_events, 1) + wait, -1)
    hit = np.searchsorted(pairs, query)
    found = (hit < len(pairs)) & (pairs[np.minimum(hit, len(pairs) - 1)] == query)
    return ok & found


def _gate_signals(g: TaskGraph, pred: np.ndarray, wait: np.ndarray, gated: np.ndarray,
                  new_event: np.ndarray, both: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(signalling task, extra event) pairs: the predecessor of every gated task, and
    the signallers of the original event where both are needed."""
    sig_task, sig_ev = g.signaller(), g.signals_global()
    by_event = np.argsort(sig_ev, kind="stable")
    ev_ptr = np.zeros(g.num_events + 1, np.int64)
    np.cumsum(np.bincount(sig_ev, minlength=g.num_events), out=ev_ptr[1:])
    sel = both[gated]
    events = wait[gated[sel]]
    producers = gather_csr(ev_ptr, sig_task[by_event], events)
    target = np.repeat(new_event[sel], ev_ptr[events + 1] - ev_ptr[events])
    return np.concatenate([pred[gated], producers]), np.concatenate([new_event, target])


def _legend(schedule: Schedule, ext: QueueOrderGraph, message: str) -> str:
    """Name the queue-order events that appear in ``message``."""
    g = schedule.graph
    names, preds = [], queue_predecessor(schedule)
    for ev in sorted({int(m) for m in re.findall(r"queue-order event (\d+)", message)}):
        i = int(ext.gated[ev - g.num_events])
        pred = int(preds[i])
        names.append(f"queue-order event {ev}: {schedule.describe_queue(int(schedule.queue[i]))} "
                     f"runs [{g.task(i)}] after [{g.task(pred)}]")
    return "; ".join(names) if names else "cycle through the graph's own events"

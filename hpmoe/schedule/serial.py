"""The kernel-by-kernel baseline: one phase per task kind, a barrier between phases.

A framework that runs MoE operators one after another launches one kernel per op:
shared-expert GEMM / SwiGLU / GEMM, permute, dispatch all-to-all, GEMM_UP, SwiGLU,
GEMM_DOWN, combine all-to-all, unpermute.  Each kernel spreads its tiles over every
worker of its unit; the next starts when the previous has finished on that rank.  An
all-to-all finishes on a rank only when the rank's own puts are done *and* every put
addressed to it has arrived.  Plan of ``serial_schedule``:
  1. phase order: the task kinds in an order that respects every dependency between
     kinds, shared-expert kinds first where there is a choice;
  2. barrier events, per (rank, phase): signalled by the phase's tasks on the rank and
     by the phase's puts arriving at it; a phase with no task of its own on a rank but
     with arrivals also collects every signal of the rank's previous barrier, so the
     chain of barriers never skips a phase;
  3. every task waits on the last non-empty barrier before its phase on its rank
     (which implies its own event), or keeps its own wait when there is none;
  4. each phase's tasks are dealt round-robin over the workers of their unit, puts in
     staggered destination order (as an all-to-all library orders them).
"""

from __future__ import annotations

import heapq
from dataclasses import replace

import numpy as np

from ..ir.graph import IS_PUT, TaskGraph, TaskKind
from ..ir.schedule import Schedule, SchedulePolicy, WorkerCounts, schedule_from_assignment
from .hyperparallel import deal_round_robin, stagger

SHARED_KINDS = frozenset({TaskKind.SHARED_UP, TaskKind.SHARED_SWIGLU, TaskKind.SHARED_DOWN,
                          TaskKind.SHARED_DGRAD_DOWN, TaskKind.SHARED_WGRAD_DOWN,
                          TaskKind.SHARED_SWIGLU_BWD, TaskKind.SHARED_DGRAD_UP,
                          TaskKind.SHARED_WGRAD_UP})
# off the barrier chain under overlap_shared
OFF_CHAIN = SHARED_KINDS | {TaskKind.UNPERMUTE, TaskKind.GRAD_UNPERMUTE, TaskKind.PARTIAL_SUM}


def serial_schedule(graph: TaskGraph, workers: WorkerCounts, overlap_shared: bool = False) -> Schedule:
    """The baseline schedule; its ``graph`` is ``graph`` plus the phase barriers.  With
    ``overlap_shared`` the shared-expert kernels stay off the barrier chain (they run
    beside permute and dispatch, as Megatron overlaps them) and each unpermute (or
    partial-sum) tile starts when its own rows are in."""
    kinds = phase_order(graph)
    table = np.full(len(TaskKind), -1, np.int64)
    table[list(kinds)] = np.arange(len(kinds))
    phase = table[graph.kind]
    chained = ~np.isin(graph.kind, list(OFF_CHAIN)) if overlap_shared else None
    barred = add_barriers(graph, phase, len(kinds), chained)
    worker, priority = deal_round_robin(barred, workers, (phase, stagger(barred)), restart=phase)
    return schedule_from_assignment(barred, SchedulePolicy.SERIAL, workers, worker, priority)


def kind_dependencies(graph: TaskGraph) -> np.ndarray:
    """[K, K] bool: some task of kind a signals an event a task of kind b waits on."""
    k = len(TaskKind)
    signals, wait = graph.signals_global(), graph.wait_global()
    made = np.zeros((graph.num_events, k), np.int64)
    made[signals, graph.kind[graph.signaller()]] = 1
    waited = np.zeros((graph.num_events, k), np.int64)
    has = wait >= 0
    waited[wait[has], graph.kind[has]] = 1
    return (made.T @ waited) > 0


def phase_order(graph: TaskGraph) -> tuple[TaskKind, ...]:
    """The kinds present in ``graph`` in dependency order (Kahn's algorithm), shared-expert
    kinds first, then by kind value, among the kinds that are free to go next."""
    deps = kind_dependencies(graph)
    present = [TaskKind(k) for k in np.unique(graph.kind).tolist()]
    indegree = {k: int(sum(deps[j, k] for j in present if j != k)) for k in present}
    loops = [k.name for k in present if deps[k, k]]
    if loops:
        raise ValueError(f"kinds {loops} depend on themselves: no kernel-by-kernel order exists")
    ready = [(k not in SHARED_KINDS, int(k)) for k in present if indegree[k] == 0]
    heapq.heapify(ready)
    order: list[TaskKind] = []
    while ready:
        k = TaskKind(heapq.heappop(ready)[1])
        order.append(k)
        for j in present:
            if deps[k, j] and j != k:
                indegree[j] -= 1
                if indegree[j] == 0:
                    heapq.heappush(ready, (j not in SHARED_KINDS, int(j)))
    if len(order) != len(present):
        raise ValueError(f"kinds {sorted(set(k.name for k in present) - {k.name for k in order})} "
                         "depend on each other in a cycle: no kernel-by-kernel order exists")
    return tuple(order)


def add_barriers(graph: TaskGraph, phase: np.ndarray, phases: int,
                 chained: np.ndarray | None = None) -> TaskGraph:
    """``graph`` with one barrier event per non-empty (rank, phase) (see module plan);
    tasks outside ``chained`` (default: none) neither signal nor wait on barriers."""
    chained = np.ones(graph.num_tasks, bool) if chained is None else chained
    task, rank, ph = _barrier_signals(graph, phase, phases, chained)
    thr = np.bincount(rank * phases + ph, minlength=graph.ep * phases).reshape(graph.ep, phases)
    has = thr > 0
    old_count = np.diff(graph.event_ptr)
    local = old_count[:, None] + np.cumsum(has, axis=1) - has  # [ep, phases] barrier local ids
    event_ptr = np.zeros(graph.ep + 1, np.int64)
    np.cumsum(old_count + has.sum(axis=1), out=event_ptr[1:])
    threshold = np.concatenate([np.concatenate([graph.threshold[graph.event_ptr[r]:graph.event_ptr[r + 1]],
                                                thr[r][has[r]]]) for r in range(graph.ep)])
    prev = _previous_barrier(has)[graph.rank, phase]
    wait = np.where((prev >= 0) & chained, local[graph.rank, np.maximum(prev, 0)], graph.wait)
    all_task = np.concatenate([graph.signaller(), task])
    order = np.argsort(all_task, kind="stable")
    sig_ptr = np.zeros(graph.num_tasks + 1, np.int64)
    np.cumsum(np.bincount(all_task, minlength=graph.num_tasks), out=sig_ptr[1:])
    sig_rank = np.concatenate([graph.sig_rank, rank.astype(np.int32)])[order]
    sig_event = np.concatenate([graph.sig_event, local[rank, ph]])[order]
    return replace(graph, wait=wait, sig_ptr=sig_ptr, sig_rank=sig_rank, sig_event=sig_event,
                   event_ptr=event_ptr, threshold=threshold.astype(np.int64))


def _barrier_signals(graph: TaskGraph, phase: np.ndarray, phases: int,
                     chained: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(task, barrier rank, barrier phase) of every barrier signal: each ``chained`` task
    signals its own rank's barrier; each chained put also the barrier of its peer."""
    mine = np.flatnonzero(chained)
    puts = np.flatnonzero(IS_PUT[graph.kind] & chained)
    task = np.concatenate([mine, puts])
    rank = np.concatenate([graph.rank[mine], graph.peer[puts]]).astype(np.int64)
    own = np.bincount(graph.rank[mine] * phases + phase[mine],
                      minlength=graph.ep * phases).reshape(graph.ep, phases)
    arrive = np.bincount(graph.peer[puts] * phases + phase[puts],
                         minlength=graph.ep * phases).reshape(graph.ep, phases)
    return _chain_empty_phases(task, rank, phase[task], own, arrive)


def _chain_empty_phases(task: np.ndarray, rank: np.ndarray, ph: np.ndarray, own: np.ndarray,
                        arrive: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where a rank has arrivals but no task of its own in a phase, copy every signal
    of the rank's previous non-empty barrier into that phase's barrier."""
    for r, q in zip(*np.nonzero((own == 0) & (arrive > 0)), strict=True):
        nonempty = np.flatnonzero(np.bincount(ph[rank == r], minlength=own.shape[1])[:q] > 0)
        if nonempty.size:
            sel = (rank == r) & (ph == nonempty[-1])
            task = np.concatenate([task, task[sel]])
            rank = np.concatenate([rank, rank[sel]])
            ph = np.concatenate([ph, np.full(int(sel.sum()), q)])
    return task, rank, ph


def _previous_barrier(has: np.ndarray) -> np.ndarray:
    """[ep, phases] the latest phase q < p with a barrier on the rank, -1 when none."""
    idx = np.where(has, np.arange(has.shape[1]), -1)
    latest = np.maximum.accumulate(idx, axis=1)
    return np.concatenate([np.full((has.shape[0], 1), -1), latest[:, :-1]], axis=1)

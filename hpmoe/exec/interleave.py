"""Interleavings of a scheduled region as the persistent kernel may run it, executed by
the exact executor: a check of the kernel's ordering that needs no GPU.

The device runs each worker queue in order; a task starts once its event reached its
threshold and signals its events when done; the queues advance independently, at
speeds nothing bounds (a program may start late, or share its SM).  ``device_order``
draws one such interleaving: each queue gets a random start delay and a random speed,
and each step visits the queues in a random order and runs at most one task of each
that moves this step (the head, if its wait is satisfied), so a task runs before a
producer whenever the waits allow it.  ``interleaved_forward`` runs a
forward region in that order on buffers poisoned with NaN (a read of a row no task
wrote yet shows in the output), optionally with one task's wait removed
(``drop_wait``): the mutation a test must catch.  ``interleaved_slot_forward`` does the
same for a per-shape plan (``regions.slots``): one schedule, made once, under every
routing resolved onto it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ..ir.analysis import GraphError
from ..ir.graph import TaskGraph
from ..ir.schedule import Schedule, WorkerCounts
from ..regions.slot_routing import resolve_slots
from ..regions.slots import SlotPlan
from ..routing import Routing
from ..schedule import SchedulePolicy, schedule
from ..sim.presets import hardware_preset
from ..spec import TileSpec
from ..weights import ExpertWeights
from .exact import ForwardResult, PreparedForward, prepare_forward, prepare_slot_forward
from .exact_backward import Gradients, PreparedSlotBackward, prepare_slot_backward


def device_order(sched: Schedule, graph: TaskGraph, rng: np.random.Generator) -> np.ndarray:
    """A global task order of ``sched``'s queues that the device could produce under
    ``graph``'s waits (see the module).  GraphError when no queue can advance."""
    wait = graph.wait_global()
    need = np.where(wait >= 0, graph.threshold[np.maximum(wait, 0)], 0)
    signals = graph.signals_global()
    counts = np.zeros(graph.num_events, np.int64)
    head, end = sched.queue_ptr[:-1].copy(), sched.queue_ptr[1:]
    start = rng.integers(0, graph.num_tasks + 1, sched.num_queues)  # steps before a queue starts
    speed = 10.0 ** rng.uniform(-2, 0, sched.num_queues)  # chance a started queue moves in a step
    order: list[int] = []
    step = 0
    while len(order) < graph.num_tasks:
        step += 1
        moved = False
        for q in rng.permutation(sched.num_queues):
            if head[q] == end[q]:
                continue
            if step < start[q] or rng.random() > speed[q]:
                moved = True  # it may move later: not a deadlock
                continue
            t = int(sched.queue_task[head[q]])
            if wait[t] >= 0 and counts[wait[t]] < need[t]:
                continue
            order.append(t)
            head[q] += 1
            np.add.at(counts, signals[graph.sig_ptr[t]:graph.sig_ptr[t + 1]], 1)
            moved = True
        if not moved:
            stuck = [graph.task(int(sched.queue_task[head[q]])) for q in np.flatnonzero(head < end)]
            raise GraphError(f"no queue can advance after {len(order)} tasks; heads: {stuck[:4]}")
    return np.asarray(order, np.int64)


def implied_waits(sched: Schedule, graph: TaskGraph) -> np.ndarray:
    """[n] bool: tasks whose wait the rest of the program already guarantees: every task
    signalling its event happens before it through queue order and the other tasks'
    waits.  Removing such a wait changes no interleaving's result; every other wait is
    needed.  (Ancestor sets as bit masks, built in an order the program can run in.)"""
    wait, signals, signaller = graph.wait_global(), graph.signals_global(), graph.signaller()
    producers = {int(ev): 0 for ev in np.unique(wait[wait >= 0])}
    for p, ev in zip(signaller.tolist(), signals.tolist(), strict=True):
        if ev in producers:
            producers[ev] |= 1 << p
    before = np.full(graph.num_tasks, -1)  # the task ahead in the same queue
    for q in range(sched.num_queues):
        tasks = sched.queue_task[sched.queue_ptr[q]:sched.queue_ptr[q + 1]]
        before[tasks[1:]] = tasks[:-1]
    ancestors = [0] * graph.num_tasks  # through every edge
    out = np.zeros(graph.num_tasks, bool)
    for t in device_order(sched, graph, np.random.default_rng(0)).tolist():
        b = int(before[t])
        queue_only = 0 if b < 0 else ancestors[b] | 1 << b
        need = producers.get(int(wait[t]), 0)
        out[t] = wait[t] >= 0 and need & ~queue_only == 0
        waited = 0
        p_mask = need
        while p_mask:
            low = p_mask & -p_mask
            p = low.bit_length() - 1
            waited |= ancestors[p] | low
            p_mask ^= low
        ancestors[t] = queue_only | waited
    return out


def drop_wait(graph: TaskGraph, task: int) -> TaskGraph:
    """``graph`` with ``task``'s wait removed."""
    wait = graph.wait.copy()
    wait[task] = -1
    return dataclasses.replace(graph, wait=wait)


@dataclass(frozen=True)
class Interleaving:
    """How ``interleaved_forward`` schedules and orders the region."""

    policy: SchedulePolicy = SchedulePolicy.HYPERPARALLEL
    workers: WorkerCounts = WorkerCounts(matrix=2, vector=2)
    seed: int = 0
    dropped: int | None = None  # the task whose wait is removed, or None


def interleaved_forward(x: torch.Tensor, weights: ExpertWeights, routing: Routing, ep: int, tiles: TileSpec,
                        how: Interleaving) -> torch.Tensor:
    """The forward output [N, H] of the region scheduled and interleaved as ``how`` says,
    every work buffer starting as NaN."""
    prepared = prepare_forward(x, weights, routing, ep, tiles)
    return interleaved_run(prepared, interleaving_schedule(prepared.graph, how), how).out


def interleaved_slot_forward(plan: SlotPlan, sched: Schedule, x: torch.Tensor, weights: ExpertWeights,
                             routing: Routing, how: Interleaving) -> torch.Tensor:
    """The forward output [N, H] of the per-shape ``plan`` under its one schedule
    ``sched`` (``interleaving_schedule(plan.graph, how)``, made once for every routing),
    this call's ``routing`` resolved onto its slots, interleaved as ``how`` says on
    NaN-poisoned buffers."""
    return interleaved_run(prepare_slot_forward(plan, x, weights, routing), sched, how).out


def interleaved_slot_backward(forward: SlotPlan, backward: SlotPlan, sched: Schedule, x: torch.Tensor,
                              weights: ExpertWeights, routing: Routing, dy: torch.Tensor,
                              how: Interleaving) -> Gradients:
    """The gradients of the per-shape ``backward`` plan under its one schedule ``sched``
    after the per-shape ``forward`` ran in task order, this call's routing resolved onto
    both, the backward interleaved as ``how`` says on NaN-poisoned buffers."""
    fwd = prepare_slot_forward(forward, x, weights, routing)
    fwd.run()
    slots = resolve_slots(routing.ids, forward.shape)
    prepared = prepare_slot_backward(backward, fwd.buffers[0], slots, dy, weights, routing)
    return interleaved_run(prepared, sched, how)


def interleaving_schedule(graph: TaskGraph, how: Interleaving) -> Schedule:
    """``graph`` scheduled under ``how``'s policy on its workers."""
    hw = dataclasses.replace(hardware_preset("h100"), matrix_workers=how.workers.matrix,
                             vector_workers=how.workers.vector)
    return schedule(graph, how.policy, hw)


def interleaved_run(prepared: PreparedForward | PreparedSlotBackward, sched: Schedule,
                    how: Interleaving) -> ForwardResult | Gradients:
    """Run ``prepared`` in a device order of ``sched`` drawn with ``how.seed`` (its
    ``dropped`` task's wait removed), every floating buffer but the inputs x and dy (and
    the forward's, which a backward keeps in ``saved``) NaN first; what its run returns."""
    graph = prepared.graph if how.dropped is None else drop_wait(prepared.graph, how.dropped)
    for buffers in prepared.buffers:
        for f in dataclasses.fields(buffers):
            t = getattr(buffers, f.name)
            if f.name not in ("x", "dy") and isinstance(t, torch.Tensor) and t.is_floating_point():
                t.fill_(float("nan"))
    return prepared.run(device_order(sched, graph, np.random.default_rng(how.seed)), graph)

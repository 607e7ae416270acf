"""What the executor runs, independent of forward or backward.

A ``Taskflow`` names a region type: its kernel table, which task kinds are puts
(and which buffer fields they read and write), the symmetric fields of its buffer
type, and how to lower a plan and size every rank's symmetric memory.  A
``RankProgram`` is one rank's graph and schedule flattened into Python lists for
the worker threads' hot loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ir.graph import IS_PUT, TaskGraph, TaskKind, Unit, task_columns
from ..ir.verify import gather_csr
from ..regions.kernels import Tile, tiles_of
from ..routing import RoutingPlan
from ..schedule.base import Schedule
from ..spec import TileSpec

Kernel = Callable[[Tile, object, object, object], None]
ShapeMap = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class PutSpec:
    """A put copies rows ``[row0, row1)`` of the sender's field ``src`` into rows
    ``[dst_row0, dst_row0 + row1 - row0)`` of the peer's symmetric field ``dst``."""

    src: str
    dst: str


@dataclass(frozen=True)
class PeerView:
    """Rows ``[row0, row0 + rows)`` of a peer's symmetric field ``field``."""

    field: str
    row0: int
    rows: int


@dataclass(frozen=True)
class Taskflow:
    """A region type the executor can run.

    kernels: {TaskKind: fn(tile, me_buffers, peer_buffers, ctx)} for non-put kinds.
    puts: {TaskKind: PutSpec} for the put kinds (done by the transport).
    symmetric: fields of the buffer type that peers write into.
    lower(plan, tiles, ranks): the TaskGraph of ``ranks`` (None: every rank).
    symmetric_shapes(plan, rank): {field: (shape, dtype)} of that rank's symmetric fields.
    describe_event(graph, rank, event): a human name for forensics.
    """

    name: str
    kernels: Mapping[TaskKind, Kernel]
    puts: Mapping[TaskKind, PutSpec]
    symmetric: tuple[str, ...]
    lower: Callable[[RoutingPlan, TileSpec, tuple[int, ...] | None], TaskGraph]
    symmetric_shapes: Callable[[RoutingPlan, int], ShapeMap]
    describe_event: Callable[[TaskGraph, int, int], str] = field(
        default=lambda g, r, e: f"event r{r}:{e}")

    def __post_init__(self) -> None:
        for kind, spec in self.puts.items():
            if not IS_PUT[kind]:
                raise ValueError(f"Taskflow.puts has {TaskKind(kind).name}, which is not a put kind")
            if spec.dst not in self.symmetric:
                raise ValueError(f"Taskflow.puts[{TaskKind(kind).name}].dst={spec.dst!r} is not one "
                                 f"of the symmetric fields {self.symmetric}")
        overlap = set(self.kernels) & set(self.puts)
        if overlap:
            raise ValueError(f"Taskflow.kernels also lists put kinds {sorted(overlap)}")


def symmetric_fields(buffer_type: type) -> tuple[str, ...]:
    """The fields peers write into, as the buffer type declares them in its
    ``SYMMETRIC`` class attribute."""
    fields_ = getattr(buffer_type, "SYMMETRIC", ())
    if not fields_ or not all(isinstance(f, str) for f in fields_):
        raise TypeError(f"{buffer_type.__name__} declares no symmetric fields (SYMMETRIC={fields_!r})")
    return tuple(fields_)


@dataclass(frozen=True)
class Queue:
    """One worker's ordered tasks (local task ids of the rank's graph)."""

    name: str
    unit: Unit
    index: int
    tasks: tuple[int, ...]


@dataclass(frozen=True)
class RankProgram:
    """One rank's region, as lists indexed by local task id / local event id.

    wait[i]: event task i waits on (-1: none); threshold[e]: per event.
    local_signals[i]: events of this rank task i signals when it ends.  put[i]: PutSpec
    or None; for puts, remote_signals[i] are the peer's events (signalled when the
    data has landed; for a put to this rank itself, all its events) and put_seq[i]
    the put's index among this rank's puts to that peer, in task-id order (else -1).
    """

    rank: int
    graph: TaskGraph
    tiles: list[Tile]
    wait: list[int]
    threshold: list[int]
    local_signals: list[tuple[int, ...]]
    remote_signals: list[tuple[int, ...]]
    put: list[PutSpec | None]
    put_seq: list[int]
    queues: tuple[Queue, ...]
    task_ids: np.ndarray  # [n] int64 id of each local task in the schedule's graph

    @property
    def num_tasks(self) -> int:
        return len(self.tiles)

    @property
    def num_events(self) -> int:
        return len(self.threshold)


def compile_program(schedule: Schedule, taskflow: Taskflow, rank: int) -> RankProgram:
    """Flatten ``rank``'s part of ``schedule`` (whose graph holds every rank, as the
    schedulers need) into a ``RankProgram`` over local task ids.

    Raises ValueError when a kind has neither a kernel nor a put spec, or a task
    signals an event it may not (non-puts signal only their rank, puts also their peer)."""
    full = schedule.graph
    _check_kinds(full, taskflow)
    g, ids = rank_subgraph(full, rank)
    local, remote = _split_signals(g, rank)
    is_put = IS_PUT[g.kind].tolist()
    return RankProgram(
        rank=rank, graph=g, tiles=tiles_of(g), wait=g.wait.tolist(), threshold=g.threshold.tolist(),
        local_signals=local, remote_signals=remote, put_seq=put_sequence(full)[ids].tolist(),
        queues=_queues(schedule, rank, ids), task_ids=ids,
        put=[taskflow.puts.get(TaskKind(k)) if p else None
             for k, p in zip(g.kind.tolist(), is_put, strict=True)])


def _split_signals(g: TaskGraph, rank: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Per task of ``rank``'s graph ``g``: (events of this rank it signals when it
    ends, events of its peer a put signals when its data lands)."""
    task = g.signaller()
    put = IS_PUT[g.kind][task]
    remote = put & (g.sig_rank == g.peer[task]) & (g.peer[task] != rank)
    bad = ~remote & (g.sig_rank != rank)
    if bad.any():
        i = int(task[np.flatnonzero(bad)[0]])
        raise ValueError(f"{g.task(i)} signals events of rank {int(g.sig_rank[bad][0])}: a task "
                         f"may signal only its own rank and, for a put, its peer")
    self_put = put & (g.peer[task] == rank)  # a put to this rank signals when its copy lands
    late = remote | self_put
    return _per_task(task[~late], g.sig_event[~late], g.num_tasks), \
        _per_task(task[late], g.sig_event[late], g.num_tasks)


def _per_task(task: np.ndarray, values: np.ndarray, n: int) -> list[tuple[int, ...]]:
    """[n] tuples: the ``values`` of each task id (``task`` sorted)."""
    cuts = np.cumsum(np.bincount(task, minlength=n))[:-1]
    return [tuple(part.tolist()) for part in np.split(values, cuts)]


def rank_subgraph(graph: TaskGraph, rank: int) -> tuple[TaskGraph, np.ndarray]:
    """(the graph of ``rank``'s tasks alone, their ids in ``graph``).  Event ids stay
    local ids of their owners; only ``rank``'s events (thresholds) are kept."""
    if rank not in graph.ranks:
        raise ValueError(f"rank={rank} is not among the graph's ranks {graph.ranks}")
    ids = np.flatnonzero(graph.rank == rank)
    cols = {c: getattr(graph, c)[ids] for c in task_columns()}
    counts = np.diff(graph.sig_ptr)[ids]
    sig_ptr = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(counts, out=sig_ptr[1:])
    sig = gather_csr(graph.sig_ptr, np.arange(len(graph.sig_event)), ids)
    lo, hi = int(graph.event_ptr[rank]), int(graph.event_ptr[rank + 1])
    event_ptr = np.zeros(graph.ep + 1, np.int64)
    event_ptr[rank + 1:] = hi - lo
    return TaskGraph(ep=graph.ep, ranks=(rank,), sig_ptr=sig_ptr, sig_rank=graph.sig_rank[sig],
                     sig_event=graph.sig_event[sig], event_ptr=event_ptr,
                     threshold=graph.threshold[lo:hi], meta=graph.meta, **cols), ids


def _check_kinds(g: TaskGraph, taskflow: Taskflow) -> None:
    for k in np.unique(g.kind).tolist():
        kind = TaskKind(k)
        if kind not in taskflow.kernels and kind not in taskflow.puts:
            raise ValueError(f"taskflow {taskflow.name!r} has no kernel or put spec for {kind.name}")


def put_sequence(g: TaskGraph) -> np.ndarray:
    """[n] for every put: its index among the puts of the same (rank, peer), in
    task-id order; -1 for other tasks.  Sender and receiver compute the same index
    (the receiver from a graph holding the sender's tasks)."""
    seq = np.full(g.num_tasks, -1, np.int64)
    puts = np.flatnonzero(IS_PUT[g.kind])
    key = g.rank[puts].astype(np.int64) * g.ep + g.peer[puts]
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    first = np.searchsorted(sorted_key, sorted_key, side="left")
    seq[puts[order]] = np.arange(len(puts)) - first
    return seq


def _queues(schedule: Schedule, rank: int, ids: np.ndarray) -> tuple[Queue, ...]:
    """``rank``'s queues, as local ids (positions in the sorted global ``ids``)."""
    w = schedule.workers
    out = []
    for unit in (Unit.MATRIX, Unit.VECTOR):
        for i in range(w.of(unit)):
            tasks = tuple(np.searchsorted(ids, schedule.queue_of(rank, unit, i)).tolist())
            out.append(Queue(name=f"r{rank} {unit.name.lower()} {i}", unit=unit, index=i, tasks=tasks))
    return tuple(out)

"""The one compile path: a routing plan becomes what an executor runs.

``Region.graph`` lowers every rank's graph of a region (AUTO's forecast reads it there,
below this floor); ``compile_region`` schedules it on a ``HardwareModel``'s workers with
a ``SchedulePolicy`` (and, in debug mode, proves the schedule deadlock-free);
``compile_program`` flattens one rank's part into a ``RankProgram``: Python lists for the
worker threads' hot loop.  The simulator, the exact executor, the multi-rank runtime and
the GPU backend all start here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..deprecation import deprecated
from ..ir.analysis import gather_csr
from ..ir.graph import IS_PUT, TaskGraph, TaskKind, Tile, Unit, task_columns, tiles_of
from ..ir.schedule import Schedule
from ..ir.verify import DEBUG_ENV as _DEBUG_ENV
from ..ir.verify import debug_enabled
from ..regions.base import Kernel, PutSpec, Region
from ..routing import RoutingPlan
from ..schedule import SchedulePolicy, schedule, verify_schedule
from ..sim.hardware import HardwareModel
from ..spec import TileSpec


def __getattr__(name: str) -> object:
    """``DEBUG_ENV`` lives with the graph verifier now (``ir.verify``); the old place
    answers with a warning until the next release."""
    if name == "DEBUG_ENV":
        deprecated("exec.program.DEBUG_ENV", "ir.verify.DEBUG_ENV")
        return _DEBUG_ENV
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lower(plan: RoutingPlan, region: Region, tiles: TileSpec, debug: bool | None = None) -> TaskGraph:
    """Deprecated: ``region.graph(plan, tiles, debug)`` (goes in the next release)."""
    deprecated("exec.program.lower", "Region.graph(plan, tiles, debug) compiles a region everywhere")
    return region.graph(plan, tiles, debug)


def compile_region(plan: RoutingPlan, region: Region, tiles: TileSpec, policy: SchedulePolicy,
                   hardware: HardwareModel, debug: bool | None = None) -> Schedule:
    """``Region.graph``'s graph scheduled with ``policy`` on ``hardware``'s workers (the only
    source of worker counts); ``debug`` also proves the schedule deadlock-free."""
    debug = debug_enabled() if debug is None else debug
    sched = schedule(region.graph(plan, tiles, debug), policy, hardware)
    if debug:
        verify_schedule(sched)
    return sched


@dataclass(frozen=True)
class PeerView:
    """Rows ``[row0, row0 + rows)`` of a peer's symmetric field ``field``."""

    field: str
    row0: int
    rows: int


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


def compile_program(schedule: Schedule, region: Region, rank: int) -> RankProgram:
    """Flatten ``rank``'s part of ``schedule`` (whose graph holds every rank, as the
    schedulers need) into a ``RankProgram`` over local task ids, with its queues."""
    program = rank_program(schedule.graph, region, rank)
    return replace(program, queues=_queues(schedule, rank, program.task_ids))


def rank_program(graph: TaskGraph, region: Region, rank: int) -> RankProgram:
    """``rank``'s tasks of ``graph`` (every rank's) as a ``RankProgram`` without queues.

    Raises ValueError when a kind has neither a kernel nor a put spec, or a task
    signals an event it may not (non-puts signal only their rank, puts also their peer)."""
    _check_kinds(graph, region)
    g, ids = rank_subgraph(graph, rank)
    local, remote = _split_signals(g, rank)
    is_put = IS_PUT[g.kind].tolist()
    return RankProgram(
        rank=rank, graph=g, tiles=tiles_of(g), wait=g.wait.tolist(), threshold=g.threshold.tolist(),
        local_signals=local, remote_signals=remote, put_seq=put_sequence(graph)[ids].tolist(),
        queues=(), task_ids=ids,
        put=[region.puts.get(TaskKind(k)) if p else None
             for k, p in zip(g.kind.tolist(), is_put, strict=True)])


Put = Callable[[int, "PeerView", torch.Tensor, tuple[int, ...], int], None]


def task_calls(program: RankProgram, kernels: Mapping[int, Kernel], me: object, ctx: object,
               put: Put) -> list[Callable[[], None]]:
    """A zero-argument callable per task of ``program``: its kernel on this rank's
    buffers ``me``, or, for a put, ``put(peer, view, rows, peer_signals, seq)``, which
    copies ``rows`` into the peer's symmetric ``view`` and then signals the peer.  Every
    executor runs these; they differ only in ``put`` and in who walks the tasks."""
    calls: list[Callable[[], None]] = []
    for i, t in enumerate(program.tiles):
        spec = program.put[i]
        if spec is None:
            calls.append(functools.partial(kernels[t.kind], t, me, me, ctx))
            continue
        view = PeerView(spec.dst, t.dst_row0, t.row1 - t.row0)
        src = getattr(me, spec.src)[t.row0:t.row1]
        calls.append(functools.partial(put, t.peer, view, src, program.remote_signals[i],
                                       program.put_seq[i]))
    return calls


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
                     threshold=graph.threshold[lo:hi], dtype=graph.dtype,
                     events=graph.events, nodes=graph.nodes, **cols), ids


def _check_kinds(g: TaskGraph, region: Region) -> None:
    for k in np.unique(g.kind).tolist():
        kind = TaskKind(k)
        if kind not in region.kernels and kind not in region.puts:
            raise ValueError(f"region {region.name!r} has no kernel or put spec for {kind.name}")


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

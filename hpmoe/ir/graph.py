"""The one IR: a graph of tile tasks synchronised by event counters.

Every stage reads a ``TaskGraph``: the lowering writes it, the schedulers order it,
the simulator replays it and the runtimes execute it.  A task waits on at most one
event of its own rank until that counter reaches the event's threshold, runs, then
adds one to each event it signals (on its own rank or, for puts, on the peer).
Fan-in is a threshold, fan-out is a list of signalled events — as in Mirage and the
paper, there are no edge lists.

Tasks are frozen to numpy struct-of-arrays (one array per field, one row per task),
so graphs with millions of tasks stay cheap to build and to read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np
import torch

from .events import EventLayout


class Unit(enum.IntEnum):
    """The kind of worker a task runs on."""

    MATRIX = 0  # AIC cube cores / tensor-core SMs / CPU GEMM threads
    VECTOR = 1  # AIV cores: elementwise work and one-sided communication


class TaskKind(enum.IntEnum):
    """What a tile task does.  Forward kinds first, then backward kinds."""

    PERMUTE = 0  # gather token rows into the send buffer (sorted by expert)
    DISPATCH = 1  # put send rows into the expert owner's receive buffer, signal it
    GEMM_UP = 2  # h[rows, cols] = x_e[rows] @ w13[e][cols].T
    SWIGLU = 3  # a[rows] = silu(h[rows, :F]) * h[rows, F:]
    GEMM_DOWN = 4  # y[rows, cols] = a[rows] @ w2[e][cols].T
    COMBINE = 5  # put expert outputs back into the source rank, signal it
    UNPERMUTE = 6  # out[tokens] = sum_j w_j * y_j (+ shared), fp32, slot order
    SHARED_UP = 7
    SHARED_SWIGLU = 8
    SHARED_DOWN = 9
    GRAD_PERMUTE = 10  # gather w_j * dy rows into the send buffer
    GRAD_DISPATCH = 11  # put output-gradient rows to the expert owner
    DGRAD_DOWN = 12  # da[rows, cols] = dy_e[rows] @ w2[e][:, cols]
    WGRAD_DOWN = 13  # dw2[e][cols] = dy_e[:, cols].T @ a_e
    SWIGLU_BWD = 14  # dh[rows] from da[rows] and h[rows]
    DGRAD_UP = 15  # dx_e[rows, cols] = dh[rows] @ w13[e][:, cols]
    WGRAD_UP = 16  # dw13[e][cols] = dh[:, cols].T @ x_e
    GRAD_COMBINE = 17  # put input-gradient rows back to the source rank
    GRAD_UNPERMUTE = 18  # dx[tokens] = sum_j dx_j (+ shared)
    ROUTER_GRAD = 19  # dw[t, j] = <dy[t], y_j[t]>
    SHARED_DGRAD_DOWN = 20
    SHARED_WGRAD_DOWN = 21
    SHARED_SWIGLU_BWD = 22
    SHARED_DGRAD_UP = 23
    SHARED_WGRAD_UP = 24
    SWIGLU_RECOMPUTE = 25  # backward: a[rows] recomputed from saved h[rows]
    EXPAND = 26  # copy rows received once per (token, rank) to each local expert's rows
    PARTIAL_REDUCE = 27  # part[row] = sum over the rank's experts of w_j * y_j, fp32, slot order
    PARTIAL_SUM = 28  # out[tokens] = sum of the per-rank partials, rank order (+ shared)
    HOP_DISPATCH = 29  # put token rows once per (token, destination node) to the node's relay rank
    RELAY_PACK = 30  # relay: gather received hop rows into the rows it forwards within its node
    NODE_REDUCE = 31  # relay: sum a token's partials from its node's ranks, fp32, rank order
    HOP_COMBINE = 32  # put the node partials back to the token's source rank
    ROUTER_COMBINE = 33  # put routing-weight gradients (k fp32 per row) back to the source rank
    HOP_ROUTER_COMBINE = 34  # put a node's routing-weight gradients back across nodes


_MATRIX_KINDS = {TaskKind.GEMM_UP, TaskKind.GEMM_DOWN, TaskKind.SHARED_UP, TaskKind.SHARED_DOWN,
                 TaskKind.DGRAD_DOWN, TaskKind.WGRAD_DOWN, TaskKind.DGRAD_UP, TaskKind.WGRAD_UP,
                 TaskKind.SHARED_DGRAD_DOWN, TaskKind.SHARED_WGRAD_DOWN, TaskKind.SHARED_DGRAD_UP,
                 TaskKind.SHARED_WGRAD_UP}
PUT_KINDS = frozenset({TaskKind.DISPATCH, TaskKind.COMBINE, TaskKind.GRAD_DISPATCH, TaskKind.GRAD_COMBINE,
                       TaskKind.HOP_DISPATCH, TaskKind.HOP_COMBINE, TaskKind.ROUTER_COMBINE,
                       TaskKind.HOP_ROUTER_COMBINE})
UNIT_OF_KIND = np.array([Unit.MATRIX if k in _MATRIX_KINDS else Unit.VECTOR for k in TaskKind],
                        dtype=np.int8)
IS_PUT = np.array([k in PUT_KINDS for k in TaskKind], dtype=bool)


def _column(dtype: type) -> Any:
    """A per-task column of ``TaskColumns``, with its dtype in a ``TaskGraph``."""
    return field(metadata={"dtype": dtype})


@dataclass(frozen=True, kw_only=True)
class TaskColumns:
    """The per-task columns (arrays, one row per task) that a ``TaskBlock`` builds and a
    ``TaskGraph`` holds, besides ``kind`` (and the graph's ``unit``): declared here once.

    rank: rank that runs the task.  peer: destination rank of a put (else ``rank``).
    expert: local expert index (-1 when none).  row0/row1, col0/col1: the tile, in
    the task's source buffer.  dst_row0: first row written in the destination
    buffer (puts; else ``row0``).  flops, bytes: work and memory traffic; link_bytes:
    bytes crossing to another rank.  wait: local event id waited on (-1: none).
    """

    rank: np.ndarray = _column(np.int32)
    peer: np.ndarray = _column(np.int32)
    expert: np.ndarray = _column(np.int32)
    row0: np.ndarray = _column(np.int64)
    row1: np.ndarray = _column(np.int64)
    col0: np.ndarray = _column(np.int64)
    col1: np.ndarray = _column(np.int64)
    dst_row0: np.ndarray = _column(np.int64)
    flops: np.ndarray = _column(np.float64)
    bytes: np.ndarray = _column(np.float64)
    link_bytes: np.ndarray = _column(np.float64)
    wait: np.ndarray = _column(np.int64)

    @property
    def rows(self) -> np.ndarray:
        return self.row1 - self.row0

    @property
    def cols(self) -> np.ndarray:
        return self.col1 - self.col0

    def select(self, ids: np.ndarray) -> TaskColumns:
        """Tasks ``ids``' columns, the integer ones in int64 (index arithmetic)."""
        return TaskColumns(**{name: getattr(self, name)[ids].astype(_index_dtype(dt))
                              for name, dt in TASK_COLUMNS.items()})


def _index_dtype(dtype: type) -> type:
    return np.int64 if np.dtype(dtype).kind == "i" else dtype


TASK_COLUMNS: dict[str, type] = {f.name: f.metadata["dtype"] for f in fields(TaskColumns)}
"""Each per-task column's dtype in a ``TaskGraph``."""


@dataclass(frozen=True, kw_only=True)
class TaskBlock(TaskColumns):
    """Tasks of one kind, as columns; the lowering appends these to a builder.
    sig_count: events signalled per task; sig_rank / sig_event: their owners and local
    ids, task after task."""

    kind: TaskKind
    sig_count: np.ndarray
    sig_rank: np.ndarray
    sig_event: np.ndarray

    def __len__(self) -> int:
        return len(self.rank)


@dataclass(frozen=True, kw_only=True)
class TaskGraph(TaskColumns):
    """Frozen struct-of-arrays task graph for the ranks in ``ranks``.

    Per task i (arrays of length n): kind, unit and the ``TaskColumns``.
    Signals, CSR: task i signals events ``sig_event[sig_ptr[i]:sig_ptr[i+1]]``
    owned by ranks ``sig_rank[...]``.
    Events, per rank r in ``ranks``: local ids ``0 .. event_count[r]-1``, thresholds
    ``threshold[event_ptr[r] + local]``.  ``ep`` is the size of the EP group.
    dtype: the layer's dtype (what the GEMM tiles compute in).  events: the region's
    named event layout (None for hand-built graphs), for messages and traces.  nodes:
    nodes the EP group spans (``ParallelSpec.nodes``; puts between them use the
    inter-node link tier).
    """

    ep: int
    ranks: tuple[int, ...]
    kind: np.ndarray
    unit: np.ndarray
    sig_ptr: np.ndarray
    sig_rank: np.ndarray
    sig_event: np.ndarray
    event_ptr: np.ndarray  # [ep + 1]; ranks outside ``ranks`` own no events here
    threshold: np.ndarray
    dtype: torch.dtype = torch.bfloat16
    events: EventLayout | None = field(default=None, compare=False)
    nodes: int = 1  # nodes the EP group spans (ParallelSpec.nodes): the link tier of a put

    @property
    def num_tasks(self) -> int:
        return len(self.kind)

    @property
    def num_events(self) -> int:
        return len(self.threshold)

    def wait_global(self) -> np.ndarray:
        """[n] global id of the event each task waits on, -1 when none."""
        g = self.event_ptr[self.rank] + self.wait
        return np.where(self.wait < 0, -1, g)

    def signals_global(self) -> np.ndarray:
        """[num signals] global event ids, CSR by ``sig_ptr``."""
        return self.event_ptr[self.sig_rank] + self.sig_event

    def signaller(self) -> np.ndarray:
        """[num signals] the task each signal entry belongs to."""
        return np.repeat(np.arange(self.num_tasks), np.diff(self.sig_ptr))

    def event_name(self, rank: int, event: int) -> str:
        """A readable name of ``rank``'s local ``event``, e.g. ``event r1:7 (OUT 2)``."""
        if self.events is None:
            return f"event r{rank}:{event}"
        return self.events.name(rank, event)

    def task(self, i: int) -> str:
        """A one-line human description of task ``i`` for error messages."""
        k = TaskKind(int(self.kind[i]))
        peer = f"->r{self.peer[i]}" if IS_PUT[k] else ""
        return (f"task {i} {k.name} r{self.rank[i]}{peer} e{self.expert[i]} "
                f"rows[{self.row0[i]}:{self.row1[i]}) cols[{self.col0[i]}:{self.col1[i]})")


class GraphBuilder:
    """Collects ``TaskBlock``s and event counts, then freezes them into a ``TaskGraph``."""

    def __init__(self, ep: int, ranks: tuple[int, ...]):
        self.ep = ep
        self.ranks = ranks
        self.blocks: list[TaskBlock] = []
        self.thresholds: dict[int, np.ndarray] = {}

    def add(self, block: TaskBlock) -> None:
        if len(block):
            self.blocks.append(block)

    def set_events(self, rank: int, thresholds: np.ndarray) -> None:
        self.thresholds[rank] = np.asarray(thresholds, dtype=np.int64)

    def freeze(self, dtype: torch.dtype = torch.bfloat16, events: EventLayout | None = None,
               nodes: int = 1) -> TaskGraph:
        cols = {name: _concat([getattr(b, name) for b in self.blocks], dt)
                for name, dt in TASK_COLUMNS.items()}
        kind = _concat([np.full(len(b), int(b.kind), np.int16) for b in self.blocks], np.int16)
        counts = _concat([b.sig_count for b in self.blocks], np.int64)
        sig_ptr = np.zeros(len(kind) + 1, np.int64)
        np.cumsum(counts, out=sig_ptr[1:])
        sizes = np.array([len(self.thresholds.get(r, ())) for r in range(self.ep)], np.int64)
        event_ptr = np.zeros(self.ep + 1, np.int64)
        np.cumsum(sizes, out=event_ptr[1:])
        threshold = _concat([self.thresholds[r] for r in range(self.ep) if r in self.thresholds], np.int64)
        return TaskGraph(
            ep=self.ep, ranks=self.ranks, kind=kind, unit=UNIT_OF_KIND[kind], sig_ptr=sig_ptr,
            sig_rank=_concat([b.sig_rank for b in self.blocks], np.int32),
            sig_event=_concat([b.sig_event for b in self.blocks], np.int64),
            event_ptr=event_ptr, threshold=threshold, dtype=dtype, events=events, nodes=nodes, **cols)


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype)
    return np.concatenate([np.asarray(p, dtype=dtype) for p in parts])


def task_columns() -> tuple[str, ...]:
    """Names of the per-task arrays of a ``TaskGraph``."""
    return ("kind", "unit", *TASK_COLUMNS)


class Tile(NamedTuple):
    """The fields of one task a kernel needs."""

    kind: int
    rank: int
    peer: int
    expert: int
    row0: int
    row1: int
    col0: int
    col1: int
    dst_row0: int


def tiles_of(graph: TaskGraph) -> list[Tile]:
    """Every task of ``graph`` as a ``Tile`` (built once, read by the executors)."""
    cols = [getattr(graph, name).tolist() for name in Tile._fields]
    return [Tile(*row) for row in zip(*cols, strict=True)]

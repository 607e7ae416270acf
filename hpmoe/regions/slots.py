"""The per-shape forward lowering: one task graph that serves every routing of a shape.

A routing plan's graph (``forward.lower_forward``) has a task per row block of that
routing's experts, and its waits count exactly the pieces that carry each token tile's
rows: a new routing needs a new graph, schedule and packing.  This lowering sizes for
the worst case instead, as the paper's graph and DeepGEMM's masked grouped layout do:
the permuted rows are laid out in *slots* of ``G = tiles.gemm_rows`` rows, each
expert's rows starting on a slot boundary, so ``slot_count`` slots (at most
``E + N*k / G``) hold every routing of N tokens.  A task names a slot ("row chunk c of
slot s", "column tile j of slot s"), not rows: which expert a slot serves and how many
of its rows are live are resolved per call (``slot_routing.resolve_slots``); the part
of a task beyond its slot's live rows does nothing, and a task with none still signals,
so every threshold is static.

Per slot s, in phase order (C = G / tiles.rows chunks a slot):
  PERMUTE, DISPATCH  one per chunk: gather the chunk's token rows, put them in place;
  GEMM_UP            one per column tile of 2F, after the slot's C dispatches;
  SWIGLU             one per chunk, after the slot's GEMM_UP tiles;
  GEMM_DOWN          one per column tile of H, after the slot's C SwiGLU chunks;
  COMBINE            one per chunk, after the slot's GEMM_DOWN tiles.
Shared-expert tiles run on the token rows as in ``forward``.  UNPERMUTE of a token tile
waits on one event (``SlotEvent.OUT``) that every COMBINE and every shared output tile
signals: which slots hold a token's rows depends on the routing, so the sum waits for
all of them (the price of a static plan: the unpermute does not overlap the experts).
Only EP = 1 (one device's region) is built here.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..deprecation import deprecated
from ..ir.events import EventLayout
from ..ir.graph import TaskBlock, TaskGraph, TaskKind
from ..spec import DispatchMode, MoESpec, TileSpec
from .layout import ceil_div
from .tiles import col_tiles, lower_graph, row_chunks, task_block


@dataclass(frozen=True)
class SlotShape:
    """What a per-shape plan depends on: the MoE shape (its dtype included), the tokens
    of a call and the tiles.  ``tiles.gemm_rows`` (G) must be a positive multiple of
    ``tiles.rows``; per-expert dispatch only; ``ep`` must be 1."""

    moe: MoESpec
    tokens: int
    tiles: TileSpec
    ep: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens <= 0:
            raise ValueError(f"SlotShape.tokens must be a positive int, got {self.tokens!r}")
        if self.ep != 1:
            raise ValueError(f"SlotShape.ep={self.ep!r}: a per-shape plan is built for one rank (ep=1) only")
        g, r = self.tiles.gemm_rows, self.tiles.rows
        if g <= 0 or g % r:
            raise ValueError(f"SlotShape.tiles: gemm_rows={g} must be a positive multiple of rows={r} "
                             "(a slot is whole row chunks)")
        if self.tiles.dispatch is not DispatchMode.PER_EXPERT:
            raise ValueError(f"SlotShape.tiles.dispatch must be PER_EXPERT, got {self.tiles.dispatch}")

    @property
    def rows(self) -> int:
        """Permuted rows of a call: tokens x top-k."""
        return self.tokens * self.moe.top_k

    @property
    def slots(self) -> int:
        return slot_count(self.rows, self.moe.experts, self.tiles.gemm_rows)

    @property
    def chunks(self) -> int:
        """Row chunks of ``tiles.rows`` a slot holds."""
        return self.tiles.gemm_rows // self.tiles.rows

    @property
    def capacity(self) -> int:
        """Rows of the slot layout: slots x G."""
        return self.slots * self.tiles.gemm_rows

    @property
    def token_tiles(self) -> int:
        return int(ceil_div(self.tokens, self.tiles.rows))

    @property
    def shared_blocks(self) -> int:
        return int(ceil_div(self.tokens, self.tiles.gemm_rows)) if self.moe.shared_experts else 0


def slot_count(rows: int, experts: int, block: int) -> int:
    """Slots of ``block`` rows that hold ``rows`` rows over ``experts`` experts in every
    split: an expert with n > 0 rows takes ceil(n / block) <= (n + block - 1) / block
    slots, at most min(experts, rows) experts have rows, so the sum is at most
    floor((rows + (block - 1) * min(experts, rows)) / block) <= experts + rows / block,
    and a split giving that many experts 1 + a multiple of ``block`` rows reaches it."""
    return (rows + (block - 1) * min(experts, rows)) // block


class SlotEvent(enum.IntEnum):
    """Event categories of the per-shape forward, in local-id order: PERM one per
    (slot, chunk); ROWS, H, A, Y one per slot; OUT one (every expert and shared output
    is back); SH, SA one per shared block."""

    PERM, ROWS, H, A, Y, OUT, SH, SA = range(8)


@dataclass(frozen=True)
class SlotTasks:
    """The tasks whose rows depend on the routing, as arrays [m] int64: task id, slot,
    first row within the slot, rows at most (``tiles.rows`` or G); and whether each
    reads its slot's expert's weights.  A call's live rows of task i are
    ``clip(slot_rows[slot[i]] - offset[i], 0, cap[i])``."""

    task: np.ndarray
    slot: np.ndarray
    offset: np.ndarray
    cap: np.ndarray
    expert_gemm: np.ndarray  # [m] bool


@dataclass(frozen=True)
class ExpertTasks:
    """Tasks over all of one expert's rows (a weight gradient's full reduction), arrays
    [m] int64: task id and expert.  A call's rows of task i start at its expert's first
    slot and are as many as the expert's rows."""

    task: np.ndarray
    expert: np.ndarray

    @staticmethod
    def of(graph: TaskGraph, kinds: list[TaskKind]) -> ExpertTasks:
        task = np.flatnonzero(np.isin(graph.kind, kinds))
        return ExpertTasks(task=task, expert=graph.expert[task].astype(np.int64))


@dataclass(frozen=True)
class SlotPlan:
    """A region planned once per shape: its graph (slot tasks at capacity, their expert
    -1, and expert tasks over no rows, until resolved) and which tasks a routing resolves."""

    shape: SlotShape
    graph: TaskGraph
    slot_tasks: SlotTasks
    expert_tasks: ExpertTasks


def slot_events(shape: SlotShape) -> EventLayout:
    s, b = shape.slots, shape.shared_blocks
    return EventLayout.from_sizes(SlotEvent, np.array([[s * shape.chunks, s, s, s, s, 1, b, b]]))


def plan_slots(shape: SlotShape) -> SlotPlan:
    """The per-shape forward plan of ``shape`` (a pure function of it)."""
    graph = lower_slots(shape, _PHASES, slot_events(shape))
    return SlotPlan(shape=shape, graph=graph, slot_tasks=slot_tasks(shape, graph, _SLOT_KINDS, _EXPERT_GEMMS),
                    expert_tasks=ExpertTasks.of(graph, []))


def lower_slots(shape: SlotShape, phases: Sequence[Callable[[SlotShape, EventLayout], TaskBlock]],
                events: EventLayout) -> TaskGraph:
    """The graph of a per-shape plan's ``phases`` (its one rank), every threshold static:
    tasks at capacity all signal, whatever the routing."""
    return lower_graph([functools.partial(make, shape) for make in phases], events, events, np.ones(1, bool),
                       events, shape.moe.dtype)


_SLOT_KINDS = [TaskKind.PERMUTE, TaskKind.DISPATCH, TaskKind.GEMM_UP, TaskKind.SWIGLU, TaskKind.GEMM_DOWN,
               TaskKind.COMBINE]
_EXPERT_GEMMS = [TaskKind.GEMM_UP, TaskKind.GEMM_DOWN]


def slot_tasks(shape: SlotShape, graph: TaskGraph, kinds: list[TaskKind], gemms: list[TaskKind]) -> SlotTasks:
    """The ``SlotTasks`` of ``graph``: its tasks of ``kinds``, those of ``gemms`` reading
    their slot's expert's weights."""
    task = np.flatnonzero(np.isin(graph.kind, kinds))
    g = shape.tiles.gemm_rows
    slot = graph.row0[task] // g
    return SlotTasks(task=task, slot=slot, offset=graph.row0[task] - slot * g,
                     cap=graph.row1[task] - graph.row0[task], expert_gemm=np.isin(graph.kind[task], gemms))


# ------------------------------------------------------------------ slot tasks

def slot_chunks(shape: SlotShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slot, row0, row1) of every row chunk of every slot, at capacity."""
    g = shape.tiles.gemm_rows
    slot = np.arange(shape.slots)
    parent, r0, r1 = row_chunks(slot * g, (slot + 1) * g, shape.tiles.rows)
    return slot[parent], r0, r1


def chunk_tasks(shape: SlotShape, ev: EventLayout, kind: TaskKind, width: int,
                wait: tuple[enum.IntEnum, str] | None, signals: list[tuple[enum.IntEnum, str]]) -> TaskBlock:
    """One task per chunk of every slot, ``width`` columns wide; an event is indexed by
    the task's 'chunk', its 'slot', or is the category's 'one' event."""
    slot, r0, r1 = slot_chunks(shape)
    n = len(slot)
    index = {"chunk": np.arange(n), "slot": slot, "one": np.zeros(n, np.int64)}
    sig = np.stack([ev.base(0, cat) + index[by] for cat, by in signals], axis=1).ravel()
    cols = {"sig_event": sig, "sig_count": np.full(n, len(signals)), "sig_rank": np.zeros(len(sig), np.int64)}
    if wait is not None:
        cols["wait"] = ev.base(0, wait[0]) + index[wait[1]]
    return task_block(kind, np.zeros(n, np.int64), r0, r1, col1=np.full(n, width),
                      bytes=2 * (r1 - r0) * width * shape.moe.dtype.itemsize, **cols)


def _permute(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    return chunk_tasks(shape, ev, TaskKind.PERMUTE, shape.moe.hidden, None, [(SlotEvent.PERM, "chunk")])


def _dispatch(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    return chunk_tasks(shape, ev, TaskKind.DISPATCH, shape.moe.hidden, (SlotEvent.PERM, "chunk"),
                       [(SlotEvent.ROWS, "slot")])


def _swiglu(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    blk = chunk_tasks(shape, ev, TaskKind.SWIGLU, shape.moe.ffn, (SlotEvent.H, "slot"),
                      [(SlotEvent.A, "slot")])
    return replace(blk, flops=5.0 * blk.rows * shape.moe.ffn)


def _combine(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    return chunk_tasks(shape, ev, TaskKind.COMBINE, shape.moe.hidden, (SlotEvent.Y, "slot"),
                       [(SlotEvent.OUT, "one")])


def slot_gemm(shape: SlotShape, ev: EventLayout, kind: TaskKind, width: int, depth: int, wait: SlotEvent,
               signal: SlotEvent) -> TaskBlock:
    """Column tiles of every slot's GEMM [G, depth] @ [depth, width-tile]."""
    g = shape.tiles.gemm_rows
    slot, col0, col1 = col_tiles(width, shape.tiles, shape.slots)
    n = col1 - col0
    esize = shape.moe.dtype.itemsize
    return task_block(kind, np.zeros(len(slot), np.int64), slot * g, (slot + 1) * g, col0=col0, col1=col1,
                      flops=2.0 * g * n * depth, bytes=(g * depth + g * n + n * depth) * esize,
                      wait=ev.base(0, wait) + slot, sig_event=ev.base(0, signal) + slot)


def _gemm_up(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    moe = shape.moe
    return slot_gemm(shape, ev, TaskKind.GEMM_UP, 2 * moe.ffn, moe.hidden, SlotEvent.ROWS, SlotEvent.H)


def _gemm_down(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    moe = shape.moe
    return slot_gemm(shape, ev, TaskKind.GEMM_DOWN, moe.hidden, moe.ffn, SlotEvent.A, SlotEvent.Y)


# ------------------------------------------------------------------ token side

def shared_rows(shape: SlotShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block, row0, row1) of the shared-expert row blocks (G token rows each)."""
    b = np.arange(shape.shared_blocks)
    g = shape.tiles.gemm_rows
    return b, b * g, np.minimum((b + 1) * g, shape.tokens)


def shared_gemm(shape: SlotShape, ev: EventLayout, kind: TaskKind, width: int, depth: int,
                wait: enum.IntEnum | None, signal: enum.IntEnum, single: bool = False) -> TaskBlock:
    """Column tiles of every shared-expert row block's GEMM [rows, depth] @ [depth,
    width-tile], waiting on the block's ``wait`` and signalling its ``signal`` (``single``:
    the one event of that category)."""
    b, r0, r1 = shared_rows(shape)
    parent, col0, col1 = col_tiles(width, shape.tiles, len(b))
    m, n = r1[parent] - r0[parent], col1 - col0
    cols = {"col0": col0, "col1": col1, "flops": 2.0 * m * n * depth,
            "bytes": (m * depth + m * n + n * depth) * shape.moe.dtype.itemsize,
            "sig_event": ev.base(0, signal) + (0 * parent if single else b[parent])}
    if wait is not None:
        cols["wait"] = ev.base(0, wait) + b[parent]
    return task_block(kind, np.zeros(len(parent), np.int64), r0[parent], r1[parent], **cols)


def _shared_up(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    moe = shape.moe
    return shared_gemm(shape, ev, TaskKind.SHARED_UP, 2 * moe.shared_ffn, moe.hidden, None, SlotEvent.SH)


def _shared_swiglu(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    b, r0, r1 = shared_rows(shape)
    parent, c0, c1 = row_chunks(r0, r1, shape.tiles.rows)
    fs = shape.moe.shared_ffn
    return task_block(TaskKind.SHARED_SWIGLU, np.zeros(len(parent), np.int64), c0, c1,
                      col1=np.full(len(parent), fs), flops=5.0 * (c1 - c0) * fs,
                      bytes=3 * (c1 - c0) * fs * shape.moe.dtype.itemsize,
                      wait=ev.base(0, SlotEvent.SH) + b[parent],
                      sig_event=ev.base(0, SlotEvent.SA) + b[parent])


def _shared_down(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    moe = shape.moe
    return shared_gemm(shape, ev, TaskKind.SHARED_DOWN, moe.hidden, moe.shared_ffn, SlotEvent.SA,
                       SlotEvent.OUT, single=True)


def token_sums(shape: SlotShape, kind: TaskKind, flops_per_term: float, wait: np.ndarray | None) -> TaskBlock:
    """One task per token tile summing each token's k rows (and the shared expert's),
    waiting on ``wait`` (an event id, or None)."""
    t = np.arange(shape.token_tiles)
    rows, moe = shape.tiles.rows, shape.moe
    r0, r1 = t * rows, np.minimum((t + 1) * rows, shape.tokens)
    terms = moe.top_k + (1 if moe.shared_experts else 0)
    m = r1 - r0
    cols = {} if wait is None else {"wait": np.full(len(t), wait)}
    return task_block(kind, np.zeros(len(t), np.int64), r0, r1, col1=np.full(len(t), moe.hidden),
                      flops=flops_per_term * terms * m * moe.hidden,
                      bytes=(terms + 1) * m * moe.hidden * moe.dtype.itemsize, **cols)


def _unpermute(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    return token_sums(shape, TaskKind.UNPERMUTE, 2.0, ev.base(0, SlotEvent.OUT))


_PHASES = (_permute, _dispatch, _gemm_up, _swiglu, _gemm_down, _combine, _shared_up, _shared_swiglu,
           _shared_down, _unpermute)


def slot_thresholds(shape: SlotShape) -> np.ndarray:
    """Deprecated: the per-shape forward's thresholds, now counted by the lowering."""
    deprecated("regions.slots.slot_thresholds", "plan_slots(shape).graph.threshold")
    return plan_slots(shape).graph.threshold

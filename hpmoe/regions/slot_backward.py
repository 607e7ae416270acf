"""The per-shape backward lowering: the gradient of ``slots.plan_slots``'s forward, one
graph for every routing of a shape, over the forward's slot layout.

Per slot s (C row chunks a slot), in phase order:
  GRAD_PERMUTE, GRAD_DISPATCH  one per chunk: dy rows of the chunk, their routing weights
                               riding, put in place;
  DGRAD_DOWN                   one per column tile of F, after the slot's C dispatches;
  SWIGLU_BWD                   one per chunk, after the slot's DGRAD_DOWN tiles (dh,
                               w * act(h) and the rows' router gradients);
  DGRAD_UP                     one per column tile of H, after the slot's C SwiGLU chunks;
  GRAD_COMBINE                 one per chunk, after the slot's DGRAD_UP tiles.
Per expert, tasks over all its rows (one task holds a weight gradient's full reduction):
  WGRAD_DOWN, WGRAD_UP         one per column tile; which slots hold an expert's rows
                               depends on the routing, so they wait on one event that
                               every SWIGLU_BWD signals.  An expert without rows this call
                               gets a zero gradient from them.
Shared-expert tiles as in ``backward``; GRAD_UNPERMUTE and ROUTER_GRAD of a token tile
wait on one event that every GRAD_COMBINE and shared input-gradient tile signals.  The
experts' gated activation is recomputed from h (``backward_kernels.glu_router_backward``).
"""

from __future__ import annotations

import enum

import numpy as np

from ..deprecation import deprecated
from ..ir.events import EventLayout
from ..ir.graph import TaskBlock, TaskKind
from .slots import (
    ExpertTasks,
    SlotPlan,
    SlotShape,
    chunk_tasks,
    lower_slots,
    shared_gemm,
    shared_rows,
    slot_gemm,
    slot_tasks,
    token_sums,
)
from .tiles import col_tiles, row_chunks, task_block


class SlotBackwardEvent(enum.IntEnum):
    """Event categories of the per-shape backward, in local-id order: GPERM one per
    (slot, chunk); GROWS, DA, DH, DX one per slot; DHALL (every dh row written), GOUT
    (every input-gradient row back) one each; SDA, SDH one per shared block; SALL one
    with shared experts."""

    GPERM, GROWS, DA, DH, DX, DHALL, GOUT, SDA, SDH, SALL = range(10)


E = SlotBackwardEvent


def slot_backward_events(shape: SlotShape) -> EventLayout:
    s, c, b = shape.slots, shape.chunks, shape.shared_blocks
    return EventLayout.from_sizes(E, np.array([[s * c, s, s, s, s, 1, 1, b, b, 1 if b else 0]]))


def plan_slot_backward(shape: SlotShape) -> SlotPlan:
    """The per-shape backward plan of ``shape`` (a pure function of it)."""
    graph = lower_slots(shape, _PHASES, slot_backward_events(shape))
    kinds = [TaskKind.GRAD_PERMUTE, TaskKind.GRAD_DISPATCH, TaskKind.DGRAD_DOWN, TaskKind.SWIGLU_BWD,
             TaskKind.DGRAD_UP, TaskKind.GRAD_COMBINE]
    return SlotPlan(shape=shape, graph=graph,
                    slot_tasks=slot_tasks(shape, graph, kinds, [TaskKind.DGRAD_DOWN, TaskKind.DGRAD_UP]),
                    expert_tasks=ExpertTasks.of(graph, [TaskKind.WGRAD_DOWN, TaskKind.WGRAD_UP]))


# ------------------------------------------------------------------ slot tasks

def _grad_permute(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    return chunk_tasks(shape, ev, TaskKind.GRAD_PERMUTE, shape.moe.hidden, None, [(E.GPERM, "chunk")])


def _grad_dispatch(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    return chunk_tasks(shape, ev, TaskKind.GRAD_DISPATCH, shape.moe.hidden, (E.GPERM, "chunk"),
                       [(E.GROWS, "slot")])


def _dgrad_down(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    moe = shape.moe
    return slot_gemm(shape, ev, TaskKind.DGRAD_DOWN, moe.ffn, moe.hidden, E.GROWS, E.DA)


def _swiglu_bwd(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    return chunk_tasks(shape, ev, TaskKind.SWIGLU_BWD, shape.moe.ffn, (E.DA, "slot"),
                       [(E.DH, "slot"), (E.DHALL, "one")])


def _dgrad_up(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    moe = shape.moe
    return slot_gemm(shape, ev, TaskKind.DGRAD_UP, moe.hidden, 2 * moe.ffn, E.DH, E.DX)


def _grad_combine(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    return chunk_tasks(shape, ev, TaskKind.GRAD_COMBINE, shape.moe.hidden, (E.DX, "slot"), [(E.GOUT, "one")])


# ------------------------------------------------------------------ expert tasks

def _wgrad(shape: SlotShape, ev: EventLayout, kind: TaskKind, width: int, depth: int, wait: E) -> TaskBlock:
    """dW[e][cols] over all of expert e's rows, one task per (expert, column tile): no
    rows until a routing is resolved; the cost model counts an expert's most rows, T."""
    expert, col0, col1 = col_tiles(width, shape.tiles, shape.moe.experts)
    n, m, zeros = col1 - col0, shape.tokens, np.zeros(len(expert), np.int64)
    return task_block(kind, zeros, zeros, zeros, expert=expert, col0=col0, col1=col1,
                      flops=2.0 * m * n * depth,
                      bytes=(m * n + m * depth + n * depth) * shape.moe.dtype.itemsize,
                      wait=np.full(len(expert), ev.base(0, wait)))


def _wgrad_down(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    return _wgrad(shape, ev, TaskKind.WGRAD_DOWN, shape.moe.hidden, shape.moe.ffn, E.DHALL)


def _wgrad_up(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    return _wgrad(shape, ev, TaskKind.WGRAD_UP, 2 * shape.moe.ffn, shape.moe.hidden, E.DHALL)


# ------------------------------------------------------------------ shared experts and token tiles

def _shared_dgrad_down(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    moe = shape.moe
    return shared_gemm(shape, ev, TaskKind.SHARED_DGRAD_DOWN, moe.shared_ffn, moe.hidden, None, E.SDA)


def _shared_swiglu_bwd(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    b, r0, r1 = shared_rows(shape)
    parent, c0, c1 = row_chunks(r0, r1, shape.tiles.rows)
    fs, n = shape.moe.shared_ffn, len(parent)
    sig = np.stack([ev.base(0, E.SDH) + b[parent], np.full(n, ev.base(0, E.SALL))], axis=1).ravel()
    return task_block(TaskKind.SHARED_SWIGLU_BWD, np.zeros(n, np.int64), c0, c1, col1=np.full(n, fs),
                      flops=10.0 * (c1 - c0) * fs, bytes=5 * (c1 - c0) * fs * shape.moe.dtype.itemsize,
                      wait=ev.base(0, E.SDA) + b[parent], sig_count=np.full(n, 2),
                      sig_rank=np.zeros(2 * n, np.int64), sig_event=sig)


def _shared_dgrad_up(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    moe = shape.moe
    return shared_gemm(shape, ev, TaskKind.SHARED_DGRAD_UP, moe.hidden, 2 * moe.shared_ffn, E.SDH, E.GOUT,
                       single=True)


def _shared_wgrad(shape: SlotShape, ev: EventLayout, kind: TaskKind, width: int, depth: int,
                  wait: E | None) -> TaskBlock:
    """dW[cols] over every token, one task per column tile (none without shared experts)."""
    parent, col0, col1 = col_tiles(width, shape.tiles, 1 if shape.shared_blocks else 0)
    n, m, k = len(parent), shape.tokens, col1 - col0
    cols = {} if wait is None else {"wait": np.full(n, ev.base(0, wait))}
    return task_block(kind, np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, m), col0=col0, col1=col1,
                      flops=2.0 * m * k * depth,
                      bytes=(m * k + m * depth + k * depth) * shape.moe.dtype.itemsize,
                      **cols)


def _shared_wgrad_down(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    moe = shape.moe
    return _shared_wgrad(shape, ev, TaskKind.SHARED_WGRAD_DOWN, moe.hidden, moe.shared_ffn, None)


def _shared_wgrad_up(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    moe = shape.moe
    return _shared_wgrad(shape, ev, TaskKind.SHARED_WGRAD_UP, 2 * moe.shared_ffn, moe.hidden, E.SALL)


def _grad_unpermute(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    return token_sums(shape, TaskKind.GRAD_UNPERMUTE, 1.0, ev.base(0, E.GOUT))


def _router_grad(shape: SlotShape, ev: EventLayout) -> TaskBlock:
    return token_sums(shape, TaskKind.ROUTER_GRAD, 0.0, ev.base(0, E.GOUT))


_PHASES = (_grad_permute, _grad_dispatch, _dgrad_down, _swiglu_bwd, _dgrad_up, _grad_combine, _wgrad_down,
           _wgrad_up, _shared_dgrad_down, _shared_swiglu_bwd, _shared_dgrad_up, _shared_wgrad_down,
           _shared_wgrad_up, _grad_unpermute, _router_grad)


def slot_backward_thresholds(shape: SlotShape) -> np.ndarray:
    """Deprecated: the per-shape backward's thresholds, now counted by the lowering."""
    deprecated("regions.slot_backward.slot_backward_thresholds", "plan_slot_backward(shape).graph.threshold")
    return plan_slot_backward(shape).graph.threshold

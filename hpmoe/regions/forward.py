"""Forward lowering: a ``RoutingPlan`` becomes the tile task graph of the
Dispatch-to-Combine region (plus permute, unpermute and shared experts).

Per rank, in the order data flows:
  PERMUTE    one per put piece: gather its rows of x into the send buffer;
  DISPATCH   one per piece: put the rows into the expert owner's receive buffer;
  GEMM_UP    one per (GEMM block, column tile of 2F), after every piece of its block;
  SWIGLU     one per (block, <= tiles.rows rows), after all GEMM_UP tiles of the block;
  GEMM_DOWN  one per (block, column tile of H), after all SWIGLU tiles of the block;
  COMBINE    one per piece: put the expert outputs back into the source's buffer;
  UNPERMUTE  one per token tile: fixed-order fp32 weighted sum of the token's k rows
             plus the shared-expert output, after exactly the pieces and shared
             tiles that carry its rows;
  SHARED_*   shared-expert GEMM/SwiGLU tiles on the rank's own tokens.
Empty experts, ranks and tiles produce no tasks: sizes come from the actual routing.
"""

from __future__ import annotations

import enum

import numpy as np

from ..deprecation import deprecated
from ..ir.events import EventLayout
from ..ir.graph import TaskBlock, TaskGraph, TaskKind
from ..routing import RoutingPlan
from ..spec import TileSpec
from .layout import Layout, make_layout, piece_token_tiles
from .tiles import (
    SHARED_PHASES,
    UP_PHASES,
    Lowering,
    block_gemm,
    lower_graph,
    put_columns,
    select_ranks,
    task_block,
    token_tile_sums,
)


class ForwardEvent(enum.IntEnum):
    """Event categories of a forward rank, in local-id order: ROWS, H, A, Y one per GEMM
    block (rows arrived; h, a, y complete); OUT one per token tile (all its expert and
    shared rows are back); SH, SA one per shared block; PERM one per piece sent."""

    ROWS, H, A, Y, OUT, SH, SA, PERM = range(8)


def forward_events(layout: Layout) -> EventLayout:
    """The forward event layout of every rank, a pure function of ``layout``."""
    nb, sb = layout.blocks.count, layout.shared_blocks
    return EventLayout.from_columns(ForwardEvent, layout.plan.par.ep, [
        nb, nb, nb, nb, layout.token_tiles, sb, sb, layout.pieces.per_src])


def lower_forward(plan: RoutingPlan, tiles: TileSpec, ranks: tuple[int, ...] | None = None) -> TaskGraph:
    """The forward task graph of ``ranks`` (default: every rank of the EP group)."""
    _, sel = select_ranks(plan.par.ep, ranks)
    layout = make_layout(plan, tiles)
    low = Lowering(layout=layout, events=forward_events(layout), sel=sel)
    return lower_graph(_PHASES, low, low.incoming(), sel, low.events, plan.moe.dtype, plan.par.nodes)


# ------------------------------------------------------------------ dispatch side

def _permute(low: Lowering) -> TaskBlock:
    p = low.layout.pieces
    i = np.flatnonzero(low.sel[p.src])
    h = low.layout.plan.moe.hidden
    return task_block(TaskKind.PERMUTE, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                      expert=p.expert[i], bytes=2 * p.rows[i] * h * low.esize,
                      sig_event=low.events.base(p.src[i], ForwardEvent.PERM) + p.local[i])


def _dispatch(low: Lowering) -> TaskBlock:
    p, ev = low.layout.pieces, low.events
    i = np.flatnonzero(low.picks(p.src, p.dst))
    return task_block(TaskKind.DISPATCH, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                      peer=p.dst[i], dst_row0=p.recv_row0[i], sig_rank=p.dst[i],
                      wait=ev.base(p.src[i], ForwardEvent.PERM) + p.local[i],
                      sig_event=ev.base(p.dst[i], ForwardEvent.ROWS) + p.block[i], **put_columns(low, i))


def _combine(low: Lowering) -> TaskBlock:
    return return_puts(TaskKind.COMBINE, low, ForwardEvent.Y, ForwardEvent.OUT)


def return_puts(kind: TaskKind, low: Lowering, after: enum.IntEnum, arrived: enum.IntEnum) -> TaskBlock:
    """One put per piece back to its source (the expert's output rows, or their input
    gradients), after its block's ``after`` event; each signals the ``arrived`` event of
    every source token tile it carries rows of."""
    p, ev = low.layout.pieces, low.events
    picked = low.picks(p.dst, p.src)
    i = np.flatnonzero(picked)
    piece, tt = piece_token_tiles(low.layout, picked)
    return task_block(kind, p.dst[i], p.recv_row0[i], p.recv_row0[i] + p.rows[i], peer=p.src[i],
                      dst_row0=p.send_row0[i], wait=ev.base(p.dst[i], after) + p.block[i],
                      sig_count=np.bincount(np.searchsorted(i, piece), minlength=len(i)),
                      sig_rank=p.src[piece], sig_event=ev.base(p.src[piece], arrived) + tt,
                      **put_columns(low, i))


# ------------------------------------------------------------------ experts

def _gemm_down(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return block_gemm(TaskKind.GEMM_DOWN, low, moe.hidden, moe.ffn, ForwardEvent.A, ForwardEvent.Y)


# ------------------------------------------------------------------ source side

def _unpermute(low: Lowering) -> TaskBlock:
    return token_tile_sums(TaskKind.UNPERMUTE, low, 2.0, ForwardEvent.OUT)  # weighted: 2 flops a term


_PHASES = (_permute, _dispatch, *UP_PHASES, _gemm_down, _combine, *SHARED_PHASES, _unpermute)


def forward_thresholds(layout: Layout, rank: int, shared_out: np.ndarray) -> np.ndarray:
    """Deprecated: ``rank``'s forward thresholds, now counted by the lowering (``shared_out``
    is not read)."""
    deprecated("regions.forward.forward_thresholds", "lower_forward(plan, tiles, (rank,)).threshold")
    return lower_forward(layout.plan, layout.tiles, (rank,)).threshold

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

from ..ir.events import EventLayout
from ..ir.graph import GraphBuilder, TaskBlock, TaskGraph, TaskKind
from ..routing import RoutingPlan
from ..spec import TileSpec
from .layout import Layout, ceil_div, make_layout, piece_token_tiles
from .tiles import (
    Lowering,
    block_chunks,
    block_gemm,
    elementwise_chunks,
    ntiles,
    put_columns,
    select_ranks,
    shared_block_rows,
    shared_chunks,
    shared_gemm,
    signal_token_tiles,
    signals_per_token_tile,
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
    ranks, sel = select_ranks(plan.par.ep, ranks)
    layout = make_layout(plan, tiles)
    low = Lowering(layout=layout, events=forward_events(layout), sel=sel)
    builder = GraphBuilder(plan.par.ep, ranks)
    # Phase order, so that task-id order is itself a valid (serial) execution order.
    for make in _PHASES:
        builder.add(make(low))
    shared_out = signals_per_token_tile(_shared_down(low.only(0)), low, ForwardEvent.OUT)
    for r in ranks:
        builder.set_events(r, forward_thresholds(layout, r, shared_out))
    return builder.freeze(dtype=plan.moe.dtype, events=low.events, nodes=plan.par.nodes)


def forward_thresholds(layout: Layout, rank: int, shared_out: np.ndarray) -> np.ndarray:
    """Thresholds of ``rank``'s events, computed from the layout alone;
    ``shared_out``: shared-expert tiles signalling each token tile."""
    plan, blocks, pieces = layout.plan, layout.blocks, layout.pieces
    moe = plan.moe
    nb = int(blocks.count[rank])
    mine = blocks.rank == rank
    rows = np.bincount(pieces.block[pieces.dst == rank], minlength=nb)
    h = np.full(nb, ntiles(2 * moe.ffn, layout.tiles))
    a = ceil_div(blocks.row1[mine] - blocks.row0[mine], layout.tiles.rows)
    y = np.full(nb, ntiles(moe.hidden, layout.tiles))
    _, tt = piece_token_tiles(layout, pieces.src == rank)
    out = np.bincount(tt, minlength=layout.token_tiles) + shared_out
    sh = np.full(layout.shared_blocks, ntiles(2 * moe.shared_ffn, layout.tiles))
    sa = ceil_div(shared_block_rows(layout), layout.tiles.rows)
    perm = np.ones(int(pieces.per_src[rank]), np.int64)
    return np.concatenate([rows, h, a, y, out, sh, sa, perm]).astype(np.int64)


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
    i = np.flatnonzero(low.sel[p.src])
    return task_block(TaskKind.DISPATCH, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                      peer=p.dst[i], dst_row0=p.recv_row0[i], sig_rank=p.dst[i],
                      wait=ev.base(p.src[i], ForwardEvent.PERM) + p.local[i],
                      sig_event=ev.base(p.dst[i], ForwardEvent.ROWS) + p.block[i], **put_columns(low, i))


def _combine(low: Lowering) -> TaskBlock:
    p, ev = low.layout.pieces, low.events
    i = np.flatnonzero(low.sel[p.dst])
    piece, tt = piece_token_tiles(low.layout, low.sel[p.dst])
    return task_block(TaskKind.COMBINE, p.dst[i], p.recv_row0[i], p.recv_row0[i] + p.rows[i],
                      peer=p.src[i], dst_row0=p.send_row0[i],
                      wait=ev.base(p.dst[i], ForwardEvent.Y) + p.block[i],
                      sig_count=np.bincount(np.searchsorted(i, piece), minlength=len(i)),
                      sig_rank=p.src[piece], sig_event=ev.base(p.src[piece], ForwardEvent.OUT) + tt,
                      **put_columns(low, i))


# ------------------------------------------------------------------ experts

def _gemm_up(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return block_gemm(TaskKind.GEMM_UP, low, 2 * moe.ffn, moe.hidden, ForwardEvent.ROWS, ForwardEvent.H)


def _gemm_down(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return block_gemm(TaskKind.GEMM_DOWN, low, moe.hidden, moe.ffn, ForwardEvent.A, ForwardEvent.Y)


def _swiglu(low: Lowering) -> TaskBlock:
    b, ev = low.layout.blocks, low.events
    i, r0, r1 = block_chunks(low)
    moe = low.layout.plan.moe
    return elementwise_chunks(TaskKind.SWIGLU, low, b.rank[i], r0, r1, moe.ffn, passes=3,
                              flops=moe.glu.flops, expert=b.expert[i],
                              wait=ev.base(b.rank[i], ForwardEvent.H) + b.local[i],
                              sig_event=ev.base(b.rank[i], ForwardEvent.A) + b.local[i])


# ------------------------------------------------------------------ source side

def _unpermute(low: Lowering) -> TaskBlock:
    return token_tile_sums(TaskKind.UNPERMUTE, low, 2.0, ForwardEvent.OUT)  # weighted: 2 flops a term


def _shared_up(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return shared_gemm(TaskKind.SHARED_UP, low, 2 * moe.shared_ffn, moe.hidden, None, ForwardEvent.SH)


def _shared_swiglu(low: Lowering) -> TaskBlock:
    rank, b, c0, c1 = shared_chunks(low)
    return elementwise_chunks(TaskKind.SHARED_SWIGLU, low, rank, c0, c1, low.layout.plan.moe.shared_ffn,
                              passes=3, flops=5.0, wait=low.events.base(rank, ForwardEvent.SH) + b,
                              sig_event=low.events.base(rank, ForwardEvent.SA) + b)


def _shared_down(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    blk = shared_gemm(TaskKind.SHARED_DOWN, low, moe.hidden, moe.shared_ffn, ForwardEvent.SA, None)
    return signal_token_tiles(blk, low, ForwardEvent.OUT)


_PHASES = (_permute, _dispatch, _gemm_up, _swiglu, _gemm_down, _combine, _shared_up, _shared_swiglu,
           _shared_down, _unpermute)

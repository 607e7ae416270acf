"""Backward lowering: a ``RoutingPlan`` becomes the tile task graph of the backward
MoE-FFN region, over the same pieces, GEMM blocks and token tiles as the forward
graph (``layout.make_layout``), with its own event ids (``BackwardEvents``).

With y = sum_j w_j o_j + shared(x) (o_j: expert outputs), per rank, in data-flow order:
  GRAD_PERMUTE      one per piece: send rows = w_j * dy[token] (fp32 math, cast);
  GRAD_DISPATCH     one per piece: put them to the expert owner, signalling the
                    block's GROWS and the expert's GEXP ("all rows arrived");
  SWIGLU_RECOMPUTE  (recompute only) one per (block, row chunk): a from saved h,
                    signals GEXP; shared blocks (expert -1) signal SREC;
  DGRAD_DOWN        one per (block, column tile of F): da = dy_e @ w2[e], after GROWS;
  SWIGLU_BWD        one per (block, row chunk): dh from da and h, after DA;
                    signals the block's DH and the expert's DHE;
  DGRAD_UP          one per (block, column tile of H): dx_e = dh @ w13[e], after DH;
  GRAD_COMBINE      one per piece: put dx_e rows back to the source, after DX;
  WGRAD_DOWN        one per (expert, column tile of H): dw2[e][cols] = dy_e[:, cols].T @ a_e
                    over all the expert's rows, after GEXP;
  WGRAD_UP          one per (expert, column tile of 2F): dw13[e][cols] = dh_e[:, cols].T @ x_e,
                    after DHE;
  SHARED_*          dgrad, SwiGLU backward and wgrad tiles of the shared experts;
  GRAD_UNPERMUTE    one per token tile: dx = sum_j dx_j in slot order (fp32) + shared
                    dgrad, after exactly the pieces and shared tiles carrying its rows;
  ROUTER_GRAD       one per token tile: dw[t, j] = <dy[t], o_j[t]> in fp32 (no wait).
Every weight-gradient tile is one task holding its full reduction, so the result
does not depend on the execution order.  Expert weight gradients stay on the owner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.graph import GraphBuilder, TaskBlock, TaskGraph, TaskKind
from ..routing import RoutingPlan
from ..spec import TileSpec
from .forward import (
    _block,
    _col_tiles,
    _esize,
    _gemm_weight_share,
    _ntiles,
    _row_chunks,
    _shared_block_rows,
    _shared_blocks,
    _token_tiles,
)
from .layout import Layout, ceil_div, expand, make_layout, piece_token_tiles

BACKWARD_EVENTS = ("GROWS", "DA", "DH", "DX", "GEXP", "DHE", "GOUT", "SDA", "SDH", "SALL", "SREC",
                   "GPERM")


@dataclass(frozen=True)
class BackwardEvents:
    """Local event ids of every rank of the backward graph.

    Category ``c`` of rank ``r`` covers local ids ``[offset[r, i], offset[r, i + 1])``
    with ``i = BACKWARD_EVENTS.index(c)``: GROWS, DA, DH, DX one per GEMM block;
    GEXP, DHE one per local expert; GOUT one per token tile; SDA, SDH one per shared
    block; SALL, SREC one each when there are shared experts; GPERM one per piece
    the rank sends.  offset: [ep, len(BACKWARD_EVENTS) + 1] int64.
    """

    offset: np.ndarray

    def base(self, rank: np.ndarray | int, category: str) -> np.ndarray:
        """First local event id of ``category`` on ``rank``."""
        return self.offset[rank, BACKWARD_EVENTS.index(category)]

    def count(self, rank: int) -> int:
        return int(self.offset[rank, -1])


def backward_events(layout: Layout) -> BackwardEvents:
    """The backward event-id layout of every rank, a pure function of ``layout``."""
    ep, local = layout.plan.par.ep, layout.plan.local_experts
    nb = layout.blocks.count

    def full(n: int) -> np.ndarray:
        return np.full(ep, n, np.int64)

    has_shared = 1 if layout.shared_blocks else 0
    sizes = np.stack([nb, nb, nb, nb, full(local), full(local), full(layout.token_tiles),
                      full(layout.shared_blocks), full(layout.shared_blocks), full(has_shared),
                      full(has_shared), layout.pieces.per_src], axis=1)
    offset = np.zeros((ep, len(BACKWARD_EVENTS) + 1), np.int64)
    np.cumsum(sizes, axis=1, out=offset[:, 1:])
    return BackwardEvents(offset=offset)


@dataclass(frozen=True)
class _Lowering:
    """What every task-block builder reads: the layout, the event ids, the selected
    ranks ([ep] bool) and whether the SwiGLU activation is recomputed."""

    layout: Layout
    events: BackwardEvents
    sel: np.ndarray
    recompute: bool


def lower_backward(plan: RoutingPlan, tiles: TileSpec, ranks: tuple[int, ...] | None = None,
                   recompute: bool = False) -> TaskGraph:
    """The backward task graph of ``ranks`` (default: every rank of the EP group).

    ``recompute``: the SwiGLU activations (routed and shared) are recomputed from the
    saved pre-activations by SWIGLU_RECOMPUTE tasks instead of being saved."""
    ep = plan.par.ep
    ranks = tuple(range(ep)) if ranks is None else tuple(sorted(set(ranks)))
    if any(not 0 <= r < ep for r in ranks):
        raise ValueError(f"ranks={ranks} outside the EP group of size {ep}")
    if not isinstance(recompute, bool):
        raise TypeError(f"recompute must be a bool, got {recompute!r}")
    layout = make_layout(plan, tiles)
    sel = np.zeros(ep, bool)
    sel[list(ranks)] = True
    low = _Lowering(layout=layout, events=backward_events(layout), sel=sel, recompute=recompute)
    builder = GraphBuilder(ep, ranks)
    # Phase order, so that task-id order is itself a valid (serial) execution order.
    for make in _PHASES:
        builder.add(make(low))
    for r in ranks:
        builder.set_events(r, backward_thresholds(layout, r, recompute))
    return builder.freeze(meta={"layout": layout, "events": low.events, "direction": "backward",
                                "recompute": recompute})


def backward_event_name(graph: TaskGraph, rank: int, event: int) -> str:
    """A readable name of ``rank``'s local ``event``, e.g. ``event r1:7 (DX 2)``; events
    beyond the backward layout are a scheduler's barriers."""
    events = graph.meta.get("events")
    if not isinstance(events, BackwardEvents) or not 0 <= event < events.count(rank):
        return f"event r{rank}:{event} (schedule barrier)"
    k = int(np.searchsorted(events.offset[rank], event, side="right")) - 1
    return f"event r{rank}:{event} ({BACKWARD_EVENTS[k]} {event - int(events.offset[rank, k])})"


def backward_thresholds(layout: Layout, rank: int, recompute: bool = False) -> np.ndarray:
    """Thresholds of ``rank``'s backward events, computed from the layout alone."""
    moe, blocks, pieces, local = layout.plan.moe, layout.blocks, layout.pieces, layout.plan.local_experts
    mine = blocks.rank == rank
    nb = int(blocks.count[rank])
    to_me = pieces.dst == rank
    chunks = ceil_div(blocks.row1[mine] - blocks.row0[mine], layout.tiles.rows)
    per_expert = np.bincount(blocks.expert[mine], weights=chunks, minlength=local).astype(np.int64)
    rows_in = np.bincount(pieces.expert[to_me], minlength=local)
    gexp = rows_in + (per_expert if recompute else 0)
    _, tt = piece_token_tiles(layout, pieces.src == rank)
    gout = np.bincount(tt, minlength=layout.token_tiles) + _shared_dgrad_per_token_tile(layout)
    sh = _shared_thresholds(layout, recompute)
    return np.concatenate([
        np.bincount(pieces.block[to_me], minlength=nb), np.full(nb, _ntiles(moe.ffn, layout.tiles)),
        chunks, np.full(nb, _ntiles(moe.hidden, layout.tiles)), gexp, per_expert, gout, sh,
        np.ones(int(pieces.per_src[rank]), np.int64)]).astype(np.int64)


def _shared_thresholds(layout: Layout, recompute: bool) -> np.ndarray:
    """SDA, SDH, SALL, SREC thresholds (empty without shared experts)."""
    if not layout.shared_blocks:
        return np.zeros(0, np.int64)
    chunks = ceil_div(_shared_block_rows(layout), layout.tiles.rows)
    sda = np.full(layout.shared_blocks, _ntiles(layout.plan.moe.shared_ffn, layout.tiles))
    total = int(chunks.sum())
    return np.concatenate([sda, chunks, [total, total if recompute else 0]]).astype(np.int64)


def _shared_dgrad_per_token_tile(layout: Layout) -> np.ndarray:
    """SHARED_DGRAD_UP tiles that signal each token tile of one rank."""
    ep = layout.plan.par.ep
    low = _Lowering(layout=layout, events=backward_events(layout), sel=np.arange(ep) == 0,
                    recompute=False)
    blk = _shared_dgrad_up(low)
    return np.bincount(blk.sig_event - low.events.base(0, "GOUT"), minlength=layout.token_tiles)


# ------------------------------------------------------------------ source side: dispatch of dy

def _grad_permute(low: _Lowering) -> TaskBlock:
    p, ev = low.layout.pieces, low.events
    i = np.flatnonzero(low.sel[p.src])
    h = low.layout.plan.moe.hidden
    return _block(TaskKind.GRAD_PERMUTE, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                  expert=p.expert[i], col1=np.full(len(i), h), flops=p.rows[i] * h,
                  bytes=2 * p.rows[i] * h * _esize(low.layout) + 4 * p.rows[i],
                  sig_event=ev.base(p.src[i], "GPERM") + p.local[i])


def _put_columns(low: _Lowering, i: np.ndarray) -> dict:
    """Work columns shared by the backward puts of pieces ``i``."""
    p = low.layout.pieces
    nbytes = p.rows[i] * low.layout.plan.moe.hidden * _esize(low.layout)
    return {"expert": p.expert[i], "bytes": 2 * nbytes,
            "link_bytes": np.where(p.src[i] != p.dst[i], nbytes, 0)}


def _grad_dispatch(low: _Lowering) -> TaskBlock:
    p, ev = low.layout.pieces, low.events
    i = np.flatnonzero(low.sel[p.src])
    dst = p.dst[i]
    sig = np.stack([ev.base(dst, "GROWS") + p.block[i], ev.base(dst, "GEXP") + p.expert[i]], axis=1)
    return _block(TaskKind.GRAD_DISPATCH, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                  peer=dst, dst_row0=p.recv_row0[i], wait=ev.base(p.src[i], "GPERM") + p.local[i],
                  sig_count=np.full(len(i), 2), sig_rank=np.repeat(dst, 2), sig_event=sig.ravel(),
                  **_put_columns(low, i))


def _grad_combine(low: _Lowering) -> TaskBlock:
    p, ev = low.layout.pieces, low.events
    i = np.flatnonzero(low.sel[p.dst])
    piece, tt = piece_token_tiles(low.layout, low.sel[p.dst])
    return _block(TaskKind.GRAD_COMBINE, p.dst[i], p.recv_row0[i], p.recv_row0[i] + p.rows[i],
                  peer=p.src[i], dst_row0=p.send_row0[i], wait=ev.base(p.dst[i], "DX") + p.block[i],
                  sig_count=np.bincount(np.searchsorted(i, piece), minlength=len(i)),
                  sig_rank=p.src[piece], sig_event=ev.base(p.src[piece], "GOUT") + tt,
                  **_put_columns(low, i))


# ------------------------------------------------------------------ experts: dgrad

def _block_gemm(kind: TaskKind, low: _Lowering, width: int, depth: int, wait: str,
                signal: str) -> TaskBlock:
    """GEMM tiles over every selected block: [rows, depth] @ [depth, width-tile]."""
    b, ev = low.layout.blocks, low.events
    blk = np.flatnonzero(low.sel[b.rank])
    parent, col0, col1 = _col_tiles(width, low.layout.tiles, len(blk))
    i = blk[parent]
    rank, m, n = b.rank[i], b.row1[i] - b.row0[i], col1 - col0
    weights = n * depth * _gemm_weight_share(low.layout, rank, b.expert[i])
    return _block(kind, rank, b.row0[i], b.row1[i], expert=b.expert[i], col0=col0, col1=col1,
                  flops=2.0 * m * n * depth, bytes=(m * depth + m * n + weights) * _esize(low.layout),
                  wait=ev.base(rank, wait) + b.local[i], sig_event=ev.base(rank, signal) + b.local[i])


def _dgrad_down(low: _Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return _block_gemm(TaskKind.DGRAD_DOWN, low, moe.ffn, moe.hidden, "GROWS", "DA")


def _dgrad_up(low: _Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return _block_gemm(TaskKind.DGRAD_UP, low, moe.hidden, 2 * moe.ffn, "DH", "DX")


def _block_chunks(low: _Lowering) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block id, chunk row0, chunk row1) of every row chunk of the selected blocks."""
    b = low.layout.blocks
    blk = np.flatnonzero(low.sel[b.rank])
    parent, r0, r1 = _row_chunks(b.row0[blk], b.row1[blk], low.layout.tiles.rows)
    return blk[parent], r0, r1


def _swiglu_bwd(low: _Lowering) -> TaskBlock:
    b, ev = low.layout.blocks, low.events
    i, r0, r1 = _block_chunks(low)
    rank, f = b.rank[i], low.layout.plan.moe.ffn
    sig = np.stack([ev.base(rank, "DH") + b.local[i], ev.base(rank, "DHE") + b.expert[i]], axis=1)
    return _block(TaskKind.SWIGLU_BWD, rank, r0, r1, expert=b.expert[i], col1=np.full(len(i), f),
                  flops=10.0 * (r1 - r0) * f, bytes=5 * (r1 - r0) * f * _esize(low.layout),
                  wait=ev.base(rank, "DA") + b.local[i], sig_count=np.full(len(i), 2),
                  sig_rank=np.repeat(rank, 2), sig_event=sig.ravel())


def _recompute(low: _Lowering) -> TaskBlock:
    """SWIGLU_RECOMPUTE of routed blocks (signal GEXP) then shared blocks (signal SREC)."""
    if not low.recompute:
        low = _Lowering(low.layout, low.events, np.zeros_like(low.sel), False)
    b, ev = low.layout.blocks, low.events
    i, r0, r1 = _block_chunks(low)
    srank, sb, s0, s1 = _shared_blocks(low.layout, low.sel)
    parent, c0, c1 = _row_chunks(s0, s1, low.layout.tiles.rows)
    rank = np.concatenate([b.rank[i], srank[parent]])
    row0, row1 = np.concatenate([r0, c0]), np.concatenate([r1, c1])
    f = np.concatenate([np.full(len(i), low.layout.plan.moe.ffn),
                        np.full(len(parent), low.layout.plan.moe.shared_ffn)])
    sig = np.concatenate([ev.base(b.rank[i], "GEXP") + b.expert[i], ev.base(srank[parent], "SREC")])
    return _block(TaskKind.SWIGLU_RECOMPUTE, rank, row0, row1,
                  expert=np.concatenate([b.expert[i], np.full(len(parent), -1)]), col1=f,
                  flops=5.0 * (row1 - row0) * f, bytes=3 * (row1 - row0) * f * _esize(low.layout),
                  sig_event=sig)


# ------------------------------------------------------------------ experts: wgrad

def _experts(low: _Lowering) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rank, local expert, row0, row1) of every selected expert holding rows; rows are
    the expert's whole receive range."""
    plan = low.layout.plan
    ep, local = plan.par.ep, plan.local_experts
    off = plan.recv_offsets.numpy()
    start, stop = off[:, 0:local * ep:ep], off[:, ep:local * ep + 1:ep]
    rank, expert = np.nonzero((stop > start) & low.sel[:, None])
    return rank, expert, start[rank, expert], stop[rank, expert]


def _wgrad(kind: TaskKind, low: _Lowering, width: int, depth: int, wait: str) -> TaskBlock:
    """dW[e][cols] = G_e[:, cols].T @ A_e: one tile per (expert, column tile of width)."""
    rank, expert, r0, r1 = _experts(low)
    parent, col0, col1 = _col_tiles(width, low.layout.tiles, len(rank))
    rank, expert, r0, r1 = rank[parent], expert[parent], r0[parent], r1[parent]
    m, n = r1 - r0, col1 - col0
    return _block(kind, rank, r0, r1, expert=expert, col0=col0, col1=col1,
                  flops=2.0 * m * n * depth, bytes=(m * n + m * depth + n * depth) * _esize(low.layout),
                  wait=low.events.base(rank, wait) + expert)


def _wgrad_down(low: _Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return _wgrad(TaskKind.WGRAD_DOWN, low, moe.hidden, moe.ffn, "GEXP")


def _wgrad_up(low: _Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return _wgrad(TaskKind.WGRAD_UP, low, 2 * moe.ffn, moe.hidden, "DHE")


# ------------------------------------------------------------------ shared experts

def _shared_gemm(kind: TaskKind, low: _Lowering, width: int, depth: int, wait: str | None,
                 signal: str | None) -> TaskBlock:
    """GEMM tiles over every selected shared block: [rows, depth] @ [depth, width-tile]."""
    rank, b, r0, r1 = _shared_blocks(low.layout, low.sel)
    parent, col0, col1 = _col_tiles(width, low.layout.tiles, len(rank))
    rank, b, r0, r1 = rank[parent], b[parent], r0[parent], r1[parent]
    m, n = r1 - r0, col1 - col0
    cols = {"col0": col0, "col1": col1, "flops": 2.0 * m * n * depth,
            "bytes": (m * depth + m * n + n * depth / max(low.layout.shared_blocks, 1))
            * _esize(low.layout)}
    if wait:
        cols["wait"] = low.events.base(rank, wait) + b
    if signal:
        cols["sig_event"] = low.events.base(rank, signal) + b
    return _block(kind, rank, r0, r1, **cols)


def _shared_dgrad_down(low: _Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return _shared_gemm(TaskKind.SHARED_DGRAD_DOWN, low, moe.shared_ffn, moe.hidden, None, "SDA")


def _shared_swiglu_bwd(low: _Lowering) -> TaskBlock:
    ev = low.events
    rank, b, r0, r1 = _shared_blocks(low.layout, low.sel)
    parent, c0, c1 = _row_chunks(r0, r1, low.layout.tiles.rows)
    rank, b = rank[parent], b[parent]
    f = low.layout.plan.moe.shared_ffn
    sig = np.stack([ev.base(rank, "SDH") + b, ev.base(rank, "SALL")], axis=1)
    return _block(TaskKind.SHARED_SWIGLU_BWD, rank, c0, c1, col1=np.full(len(rank), f),
                  flops=10.0 * (c1 - c0) * f, bytes=5 * (c1 - c0) * f * _esize(low.layout),
                  wait=ev.base(rank, "SDA") + b, sig_count=np.full(len(rank), 2),
                  sig_rank=np.repeat(rank, 2), sig_event=sig.ravel())


def _shared_dgrad_up(low: _Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    blk = _shared_gemm(TaskKind.SHARED_DGRAD_UP, low, moe.hidden, 2 * moe.shared_ffn, "SDH", None)
    rows = low.layout.tiles.rows
    first, last = blk.row0 // rows, (blk.row1 - 1) // rows
    parent, j = expand(last - first + 1)
    blk.sig_count = last - first + 1
    blk.sig_rank = blk.rank[parent]
    blk.sig_event = low.events.base(blk.rank[parent], "GOUT") + first[parent] + j
    return blk


def _shared_wgrad(kind: TaskKind, low: _Lowering, width: int, depth: int, wait: str | None) -> TaskBlock:
    """dW[cols] = G[:, cols].T @ A over all the rank's tokens, one tile per column tile."""
    has = low.sel & bool(low.layout.shared_blocks)
    rank, _ = expand(np.where(has, 1, 0))
    parent, col0, col1 = _col_tiles(width, low.layout.tiles, len(rank))
    rank = rank[parent]
    m, n = low.layout.plan.par.tokens_per_rank, col1 - col0
    cols = {"wait": low.events.base(rank, wait)} if wait else {}
    return _block(kind, rank, np.zeros(len(rank), np.int64), np.full(len(rank), m), col0=col0,
                  col1=col1, flops=2.0 * m * n * depth,
                  bytes=(m * n + m * depth + n * depth) * _esize(low.layout), **cols)


def _shared_wgrad_down(low: _Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    wait = "SREC" if low.recompute else None
    return _shared_wgrad(TaskKind.SHARED_WGRAD_DOWN, low, moe.hidden, moe.shared_ffn, wait)


def _shared_wgrad_up(low: _Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return _shared_wgrad(TaskKind.SHARED_WGRAD_UP, low, 2 * moe.shared_ffn, moe.hidden, "SALL")


# ------------------------------------------------------------------ source side: sums

def _grad_unpermute(low: _Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    rank, t, r0, r1 = _token_tiles(low.layout, low.sel)
    m = r1 - r0
    terms = moe.top_k + (1 if moe.shared_experts else 0)
    return _block(TaskKind.GRAD_UNPERMUTE, rank, r0, r1, col1=np.full(len(rank), moe.hidden),
                  flops=1.0 * terms * m * moe.hidden,
                  bytes=(terms + 1) * m * moe.hidden * _esize(low.layout),
                  wait=low.events.base(rank, "GOUT") + t)


def _router_grad(low: _Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    rank, _, r0, r1 = _token_tiles(low.layout, low.sel)
    m = r1 - r0
    return _block(TaskKind.ROUTER_GRAD, rank, r0, r1, col1=np.full(len(rank), moe.hidden),
                  flops=2.0 * moe.top_k * m * moe.hidden,
                  bytes=(moe.top_k + 1) * m * moe.hidden * _esize(low.layout) + 4 * m * moe.top_k)


_PHASES = (_grad_permute, _grad_dispatch, _recompute, _dgrad_down, _swiglu_bwd, _dgrad_up,
           _grad_combine, _wgrad_down, _wgrad_up, _shared_dgrad_down, _shared_swiglu_bwd,
           _shared_dgrad_up, _shared_wgrad_down, _shared_wgrad_up, _grad_unpermute, _router_grad)

"""Backward lowering: a ``RoutingPlan`` becomes the tile task graph of the backward
MoE-FFN region, over the same pieces, GEMM blocks and token tiles as the forward
graph (``layout.make_layout``), with its own event ids (``BackwardEvents``).

With y = sum_j w_j o_j + shared(x) (o_j: expert outputs), per rank, in data-flow order:
  GRAD_PERMUTE      one per piece: send rows = dy[token], each with its w_j riding
                    (and x[token] beside it where the input rows travel again);
  GRAD_DISPATCH     one per piece: put them to the expert owner, signalling the
                    block's GROWS and the expert's GEXP ("all rows arrived");
  SWIGLU_RECOMPUTE  (recompute only) one per shared block row chunk: sa from saved sh,
                    signals SREC (the routed activation is recomputed by SWIGLU_BWD);
  DGRAD_DOWN        one per (block, column tile of F): d = dy_e @ w2[e], after GROWS;
  SWIGLU_BWD        one per (block, row chunk): dh, w * act(h) and the router gradient
                    <d, act(h)> from d, w and h, after DA; signals the block's DH and
                    the expert's DHE;
  DGRAD_UP          one per (block, column tile of H): dx_e = dh @ w13[e], after DH;
  GRAD_COMBINE      one per piece: put dx_e rows back to the source, the router
                    gradients riding, after DX;
  WGRAD_DOWN        one per (expert, column tile of H): dw2[e][cols] = dy_e[:, cols].T @
                    (w * act(h))_e over all the expert's rows, after DHE;
  WGRAD_UP          one per (expert, column tile of 2F): dw13[e][cols] = dh_e[:, cols].T @ x_e
                    (kept, or arrived beside dy), after DHE;
  SHARED_*          dgrad, SwiGLU backward and wgrad tiles of the shared experts;
  GRAD_UNPERMUTE    one per token tile: dx = sum_j dx_j in slot order (fp32) + shared
                    dgrad, after exactly the pieces and shared tiles carrying its rows;
  ROUTER_GRAD       one per token tile: dw[t, j], the gradient riding with slot j's row,
                    after the same.
Every weight-gradient tile is one task holding its full reduction, so the result
does not depend on the execution order.  Expert weight gradients stay on the owner.
"""

from __future__ import annotations

import enum

import numpy as np

from ..deprecation import deprecated
from ..ir.events import EventLayout
from ..ir.graph import TaskBlock, TaskGraph, TaskKind
from ..routing import RoutingPlan
from ..spec import PLAIN_GLU, TileSpec
from .base import Kept, as_kept
from .forward import return_puts
from .layout import Layout, make_layout
from .tiles import (
    Lowering,
    block_chunks,
    block_gemm,
    col_tiles,
    elementwise_chunks,
    lower_graph,
    put_columns,
    select_ranks,
    shared_chunks,
    shared_gemm,
    signal_token_tiles,
    task_block,
    token_tile_sums,
    token_tiles,
)


class BackwardEvent(enum.IntEnum):
    """Event categories of a backward rank, in local-id order: GROWS, DA, DH, DX one per
    GEMM block; GEXP, DHE one per local expert; GOUT one per token tile; SDA, SDH one per
    shared block; SALL, SREC one each when there are shared experts; GPERM one per piece
    the rank sends."""

    GROWS, DA, DH, DX, GEXP, DHE, GOUT, SDA, SDH, SALL, SREC, GPERM = range(12)


E = BackwardEvent


def backward_events(layout: Layout) -> EventLayout:
    """The backward event layout of every rank, a pure function of ``layout``."""
    local, nb, sb = layout.plan.local_experts, layout.blocks.count, layout.shared_blocks
    has_shared = 1 if sb else 0
    return EventLayout.from_columns(BackwardEvent, layout.plan.par.ep, [
        nb, nb, nb, nb, local, local, layout.token_tiles, sb, sb, has_shared, has_shared,
        layout.pieces.per_src])


def lower_backward(plan: RoutingPlan, tiles: TileSpec, ranks: tuple[int, ...] | None = None,
                   recompute: Kept | bool = False) -> TaskGraph:
    """The backward task graph of ``ranks`` (default: every rank of the EP group).

    ``recompute``: what the backward finds kept (``base.Kept``; a bool: whether the
    shared experts' activation is recomputed, rows kept).  With the activation
    recomputed, SWIGLU_RECOMPUTE tasks compute it from the saved pre-activation (the
    routed experts' always is, by SWIGLU_BWD); rows that travel again make GRAD_PERMUTE
    gather each input row beside its dy row and GRAD_DISPATCH carry both."""
    kept = as_kept(recompute)
    _, sel = select_ranks(plan.par.ep, ranks)
    layout = make_layout(plan, tiles)
    low = Lowering(layout=layout, events=backward_events(layout), sel=sel, kept=kept)
    return lower_graph(_PHASES, low, low.incoming(), sel, low.events, plan.moe.dtype, plan.par.nodes)


# ------------------------------------------------------------------ source side: dispatch of dy

def _travelling(low: Lowering) -> int:
    """Elements a backward dispatch row moves: dy's H, and H more where the input rows
    travel again beside it."""
    return low.layout.plan.moe.hidden * (2 if low.kept.travels else 1)


def _grad_permute(low: Lowering) -> TaskBlock:
    p = low.layout.pieces
    i = np.flatnonzero(low.sel[p.src])
    h, moved = low.layout.plan.moe.hidden, _travelling(low)
    return task_block(TaskKind.GRAD_PERMUTE, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                      expert=p.expert[i], col1=np.full(len(i), h), flops=p.rows[i] * moved,
                      bytes=2 * p.rows[i] * moved * low.esize + 4 * p.rows[i],
                      sig_event=low.events.base(p.src[i], E.GPERM) + p.local[i])


def _grad_dispatch(low: Lowering) -> TaskBlock:
    p, ev = low.layout.pieces, low.events
    i = np.flatnonzero(low.picks(p.src, p.dst))
    dst = p.dst[i]
    sig = np.stack([ev.base(dst, E.GROWS) + p.block[i], ev.base(dst, E.GEXP) + p.expert[i]], axis=1)
    return task_block(TaskKind.GRAD_DISPATCH, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                      peer=dst, dst_row0=p.recv_row0[i], wait=ev.base(p.src[i], E.GPERM) + p.local[i],
                      sig_count=np.full(len(i), 2), sig_rank=np.repeat(dst, 2), sig_event=sig.ravel(),
                      **put_columns(low, i, _travelling(low)))


def _grad_combine(low: Lowering) -> TaskBlock:
    return return_puts(TaskKind.GRAD_COMBINE, low, E.DX, E.GOUT)


# ------------------------------------------------------------------ experts: dgrad

def _dgrad_down(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return block_gemm(TaskKind.DGRAD_DOWN, low, moe.ffn, moe.hidden, E.GROWS, E.DA)


def _dgrad_up(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return block_gemm(TaskKind.DGRAD_UP, low, moe.hidden, 2 * moe.ffn, E.DH, E.DX)


def _swiglu_bwd(low: Lowering) -> TaskBlock:
    b, ev = low.layout.blocks, low.events
    i, r0, r1 = block_chunks(low)
    rank = b.rank[i]
    sig = np.stack([ev.base(rank, E.DH) + b.local[i], ev.base(rank, E.DHE) + b.expert[i]], axis=1)
    moe = low.layout.plan.moe
    return elementwise_chunks(TaskKind.SWIGLU_BWD, low, rank, r0, r1, moe.ffn,
                              passes=7, flops=3 * moe.glu.flops, expert=b.expert[i],
                              wait=ev.base(rank, E.DA) + b.local[i], sig_count=np.full(len(i), 2),
                              sig_rank=np.repeat(rank, 2), sig_event=sig.ravel())


def _recompute(low: Lowering) -> TaskBlock:
    """SWIGLU_RECOMPUTE of the shared blocks (signal SREC)."""
    if not low.kept.activation:
        low = Lowering(low.layout, low.events, np.zeros_like(low.sel), low.kept)
    srank, _, c0, c1 = shared_chunks(low)
    fs = low.layout.plan.moe.shared_ffn
    return task_block(TaskKind.SWIGLU_RECOMPUTE, srank, c0, c1, col1=np.full(len(srank), fs),
                      flops=PLAIN_GLU.flops * (c1 - c0) * fs, bytes=3 * (c1 - c0) * fs * low.esize,
                      sig_event=low.events.base(srank, E.SREC))


# ------------------------------------------------------------------ experts: wgrad

def _experts(low: Lowering) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rank, local expert, row0, row1) of every selected expert holding rows; rows are
    the expert's whole receive range."""
    plan = low.layout.plan
    ep, local = plan.par.ep, plan.local_experts
    off = plan.recv_offsets.numpy()
    start, stop = off[:, 0:local * ep:ep], off[:, ep:local * ep + 1:ep]
    rank, expert = np.nonzero((stop > start) & low.sel[:, None])
    return rank, expert, start[rank, expert], stop[rank, expert]


def _wgrad_tiles(kind: TaskKind, low: Lowering, rank: np.ndarray, r0: np.ndarray, r1: np.ndarray,
                 width: int, depth: int, **cols) -> TaskBlock:
    """dW[cols] = G[r0:r1, cols].T @ A[r0:r1]: one tile per (parent, column tile of width),
    each holding its whole reduction over rows."""
    parent, col0, col1 = col_tiles(width, low.layout.tiles, len(rank))
    m, n = (r1 - r0)[parent], col1 - col0
    cols = {k: v[parent] for k, v in cols.items()}
    return task_block(kind, rank[parent], r0[parent], r1[parent], col0=col0, col1=col1,
                      flops=2.0 * m * n * depth, bytes=(m * n + m * depth + n * depth) * low.esize, **cols)


def _wgrad(kind: TaskKind, low: Lowering, width: int, depth: int, wait: E) -> TaskBlock:
    rank, expert, r0, r1 = _experts(low)
    return _wgrad_tiles(kind, low, rank, r0, r1, width, depth, expert=expert,
                        wait=low.events.base(rank, wait) + expert)


def _wgrad_down(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return _wgrad(TaskKind.WGRAD_DOWN, low, moe.hidden, moe.ffn, E.DHE)


def _wgrad_up(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return _wgrad(TaskKind.WGRAD_UP, low, 2 * moe.ffn, moe.hidden, E.DHE)


# ------------------------------------------------------------------ shared experts

def _shared_dgrad_down(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return shared_gemm(TaskKind.SHARED_DGRAD_DOWN, low, moe.shared_ffn, moe.hidden, None, E.SDA)


def _shared_swiglu_bwd(low: Lowering) -> TaskBlock:
    ev = low.events
    rank, b, c0, c1 = shared_chunks(low)
    sig = np.stack([ev.base(rank, E.SDH) + b, ev.base(rank, E.SALL)], axis=1)
    return elementwise_chunks(TaskKind.SHARED_SWIGLU_BWD, low, rank, c0, c1, low.layout.plan.moe.shared_ffn,
                              passes=5, flops=10.0, wait=ev.base(rank, E.SDA) + b,
                              sig_count=np.full(len(rank), 2), sig_rank=np.repeat(rank, 2),
                              sig_event=sig.ravel())


def _shared_dgrad_up(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    blk = shared_gemm(TaskKind.SHARED_DGRAD_UP, low, moe.hidden, 2 * moe.shared_ffn, E.SDH, None)
    return signal_token_tiles(blk, low, E.GOUT)


def _shared_wgrad(kind: TaskKind, low: Lowering, width: int, depth: int, wait: E | None) -> TaskBlock:
    """dW[cols] = G[:, cols].T @ A over all the rank's tokens, one tile per column tile."""
    rank = np.flatnonzero(low.sel & bool(low.layout.shared_blocks))
    tokens = low.layout.plan.par.tokens_per_rank
    cols = {"wait": low.events.base(rank, wait)} if wait is not None else {}
    return _wgrad_tiles(kind, low, rank, np.zeros(len(rank), np.int64), np.full(len(rank), tokens),
                        width, depth, **cols)


def _shared_wgrad_down(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    wait = E.SREC if low.kept.activation else None
    return _shared_wgrad(TaskKind.SHARED_WGRAD_DOWN, low, moe.hidden, moe.shared_ffn, wait)


def _shared_wgrad_up(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    return _shared_wgrad(TaskKind.SHARED_WGRAD_UP, low, 2 * moe.shared_ffn, moe.hidden, E.SALL)


# ------------------------------------------------------------------ source side: sums

def _grad_unpermute(low: Lowering) -> TaskBlock:
    return token_tile_sums(TaskKind.GRAD_UNPERMUTE, low, 1.0, E.GOUT)  # plain sum: 1 flop a term


def _router_grad(low: Lowering) -> TaskBlock:
    """dw of a token tile: the k router gradients that came back with its rows, after GOUT."""
    moe = low.layout.plan.moe
    rank, tile, r0, r1 = token_tiles(low)
    m = r1 - r0
    return task_block(TaskKind.ROUTER_GRAD, rank, r0, r1, col1=np.full(len(rank), moe.top_k),
                      flops=np.zeros(len(rank)), bytes=8 * m * moe.top_k,
                      wait=low.events.base(rank, E.GOUT) + tile)


_PHASES = (_grad_permute, _grad_dispatch, _recompute, _dgrad_down, _swiglu_bwd, _dgrad_up,
           _grad_combine, _wgrad_down, _wgrad_up, _shared_dgrad_down, _shared_swiglu_bwd,
           _shared_dgrad_up, _shared_wgrad_down, _shared_wgrad_up, _grad_unpermute, _router_grad)


def backward_thresholds(layout: Layout, rank: int, shared_out: np.ndarray, recompute: bool = False
                        ) -> np.ndarray:
    """Deprecated: ``rank``'s backward thresholds, now counted by the lowering
    (``shared_out`` is not read)."""
    deprecated("regions.backward.backward_thresholds", "lower_backward(plan, tiles, (rank,), kept).threshold")
    return lower_backward(layout.plan, layout.tiles, (rank,), recompute).threshold

"""Rank-deduplicated forward lowering (``DispatchMode.PER_RANK``).

A token travels once to each rank holding any of its experts, and comes back as one
partial row per such rank.  Per rank, in the order data flows:
  PERMUTE         one per piece: gather x rows of (token, destination rank) pairs;
  DISPATCH        one per piece: put them into the destination's ``drecv`` rows;
  EXPAND          one per received piece: copy each row to the rows of every local
                  expert the token chose (the per-expert receive layout), signalling
                  the GEMM blocks those rows belong to (the same per-block counters);
  GEMM_UP / SWIGLU / GEMM_DOWN   as in the per-expert forward, on those blocks;
  PARTIAL_REDUCE  one per received piece, after the GEMM_DOWN tiles of every block its
                  rows were expanded into: fp32 sum of the weighted outputs of the
                  rank's experts, slot order, cast to ``tiles.partial_dtype``;
  COMBINE         one per piece: put the partial rows back to the source;
  PARTIAL_SUM     one per token tile: fp32 sum of the token's partials in rank order,
                  shared expert last (``refs.rank_partials_sum``);
  SHARED_*        shared-expert tiles on the rank's own tokens.
A piece is at most ``tiles.rows`` consecutive pairs of one (source, destination).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ..ir.events import EventLayout
from ..ir.graph import GraphBuilder, TaskBlock, TaskGraph, TaskKind
from ..routing import RoutingPlan
from ..spec import TileSpec
from .layout import Layout, ceil_div, exclusive_cumsum, expand, make_layout
from .tiles import (
    Lowering,
    block_chunks,
    block_gemm,
    elementwise_chunks,
    ntiles,
    select_ranks,
    shared_block_rows,
    shared_chunks,
    shared_gemm,
    signal_token_tiles,
    signals_per_token_tile,
    task_block,
)

PER_RANK_KINDS = frozenset({TaskKind.EXPAND, TaskKind.PARTIAL_REDUCE, TaskKind.PARTIAL_SUM})
"""Task kinds only the per-rank forward has."""


class DedupEvent(enum.IntEnum):
    """Event categories of a rank: ROWS, H, A one per GEMM block; LANDED, RED, PART
    one per piece received (rows arrived; every expert output of its rows ready; its
    partials written); OUT one per token tile; SH, SA one per shared block; PERM one
    per piece sent."""

    ROWS = 0
    H = 1
    A = 2
    LANDED = 3
    RED = 4
    PART = 5
    OUT = 6
    SH = 7
    SA = 8
    PERM = 9


@dataclass(frozen=True)
class Pairs:
    """Every (source, destination rank, token) a token travels as, sorted by
    (src, dst, token).  send_row: row in the source's send buffer (by dst, then
    token); recv_row: row in the destination's ``drecv`` (by src, then token);
    slot_row: [P, k] per-expert receive row on dst of each top-k slot (-1: the slot's
    expert is elsewhere)."""

    src: np.ndarray
    dst: np.ndarray
    token: np.ndarray
    send_row: np.ndarray
    recv_row: np.ndarray
    slot_row: np.ndarray
    per_src: np.ndarray  # [ep]
    per_dst: np.ndarray  # [ep]


@dataclass(frozen=True)
class DedupPieces:
    """Pieces of at most ``tiles.rows`` pairs of one (src, dst); ``local`` is the id
    among the source's pieces, ``rlocal`` among the destination's."""

    src: np.ndarray
    dst: np.ndarray
    send_row0: np.ndarray
    recv_row0: np.ndarray
    rows: np.ndarray
    local: np.ndarray
    rlocal: np.ndarray
    per_src: np.ndarray
    per_dst: np.ndarray


@dataclass(frozen=True)
class DedupLayout:
    """The per-expert ``Layout`` (GEMM blocks, token tiles, shared blocks) plus the
    pairs and pieces that travel, and which blocks each received piece feeds
    (``feed_piece``/``feed_block``: distinct pairs, sorted by piece)."""

    base: Layout
    pairs: Pairs
    pieces: DedupPieces
    feed_piece: np.ndarray
    feed_block: np.ndarray


def slot_rows(plan: RoutingPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(src, flat token*k + slot, dst, per-expert receive row on dst) of every routed row."""
    ep, local, k = plan.par.ep, plan.local_experts, plan.moe.top_k
    tk = plan.par.tokens_per_rank * k
    send = plan.send_offsets.numpy()
    src = np.repeat(np.arange(ep), tk)
    p = np.tile(np.arange(tk), ep)
    starts = (send[:, :-1] + (np.arange(ep) * tk)[:, None]).ravel()
    g = np.searchsorted(starts, src * tk + p, side="right") - 1 - src * plan.moe.experts
    dst, e = g // local, g % local
    recv = plan.recv_offsets.numpy()[dst, e * ep + src] + p - send[src, g]
    return src, plan.order.numpy().ravel(), dst, recv


def make_pairs(plan: RoutingPlan) -> Pairs:
    ep, tpr, k = plan.par.ep, plan.par.tokens_per_rank, plan.moe.top_k
    src, flat, dst, recv = slot_rows(plan)
    key = (src * ep + dst) * tpr + flat // k
    uniq, inv = np.unique(key, return_inverse=True)
    ps, pd, pt = uniq // (ep * tpr), (uniq // tpr) % ep, uniq % tpr
    per_src, per_dst = np.bincount(ps, minlength=ep), np.bincount(pd, minlength=ep)
    by_dst = np.argsort(pd, kind="stable")
    recv_row = np.empty(len(uniq), np.int64)
    recv_row[by_dst] = np.arange(len(uniq)) - exclusive_cumsum(per_dst)[pd[by_dst]]
    slot_row = np.full((len(uniq), k), -1, np.int64)
    slot_row[inv, flat % k] = recv
    return Pairs(src=ps, dst=pd, token=pt, send_row=np.arange(len(uniq)) - exclusive_cumsum(per_src)[ps],
                 recv_row=recv_row, slot_row=slot_row, per_src=per_src, per_dst=per_dst)


def dedup_factor(plan: RoutingPlan) -> float:
    """Rows crossing ranks with one row per (token, expert) over rows crossing with
    one row per (token, destination rank); 1.0 when nothing crosses."""
    src, _, dst, _ = slot_rows(plan)
    pairs = make_pairs(plan)
    remote = int((src != dst).sum())
    dedup = int((pairs.src != pairs.dst).sum())
    return remote / dedup if dedup else 1.0


def make_pieces(pairs: Pairs, ep: int, rows: int) -> DedupPieces:
    cnt = np.bincount(pairs.src * ep + pairs.dst, minlength=ep * ep).reshape(ep, ep)
    seg, j = expand(ceil_div(cnt, rows).ravel())
    s, d = seg // ep, seg % ep
    n = np.minimum(rows, cnt[s, d] - j * rows)
    per_src, per_dst = np.bincount(s, minlength=ep), np.bincount(d, minlength=ep)
    by_dst = np.argsort(d, kind="stable")
    rlocal = np.empty(len(s), np.int64)
    rlocal[by_dst] = np.arange(len(s)) - exclusive_cumsum(per_dst)[d[by_dst]]
    return DedupPieces(src=s, dst=d, send_row0=exclusive_cumsum(cnt, axis=1)[s, d] + j * rows,
                       recv_row0=exclusive_cumsum(cnt, axis=0)[s, d] + j * rows, rows=n,
                       local=np.arange(len(s)) - exclusive_cumsum(per_src)[s], rlocal=rlocal,
                       per_src=per_src, per_dst=per_dst)


def _feeds(base: Layout, pairs: Pairs, pieces: DedupPieces) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (received piece, GEMM block) pairs: a piece's rows are expanded into
    the block, sorted by piece."""
    pair, j = np.nonzero(pairs.slot_row >= 0)
    dst, row = pairs.dst[pair], pairs.slot_row[pair, j]
    span = int(max(base.plan.recv_offsets[:, -1].max(), 1)) + 1
    b = base.blocks
    block = np.searchsorted(b.rank * span + b.row0, dst * span + row, side="right") - 1
    pspan = int(max(pairs.per_dst.max(initial=0), 1)) + 1
    order = np.argsort(pieces.dst * pspan + pieces.recv_row0, kind="stable")
    pkeys = (pieces.dst * pspan + pieces.recv_row0)[order]
    piece = order[np.searchsorted(pkeys, dst * pspan + pairs.recv_row[pair], side="right") - 1]
    key = np.unique(piece * max(len(b.rank), 1) + block)
    return key // max(len(b.rank), 1), key % max(len(b.rank), 1)


def make_dedup_layout(plan: RoutingPlan, tiles: TileSpec) -> DedupLayout:
    """Everything the per-rank lowering needs, for every rank (a pure function of the plan)."""
    base = make_layout(plan, tiles)
    pairs = make_pairs(plan)
    pieces = make_pieces(pairs, plan.par.ep, tiles.rows)
    feed_piece, feed_block = _feeds(base, pairs, pieces)
    return DedupLayout(base=base, pairs=pairs, pieces=pieces, feed_piece=feed_piece, feed_block=feed_block)


def dedup_events(d: DedupLayout) -> EventLayout:
    base, ep = d.base, d.base.plan.par.ep
    nb, recv = base.blocks.count, d.pieces.per_dst

    def full(n: int) -> np.ndarray:
        return np.full(ep, n, np.int64)

    sizes = np.stack([nb, nb, nb, recv, recv, recv, full(base.token_tiles), full(base.shared_blocks),
                      full(base.shared_blocks), d.pieces.per_src], axis=1)
    return EventLayout.from_sizes(DedupEvent, sizes)


@dataclass(frozen=True)
class DedupLowering:
    """A ``Lowering`` over the per-expert layout plus the deduplicated layout."""

    low: Lowering
    d: DedupLayout
    partial_size: int  # bytes per element of the partials on the wire


def lower_dedup(plan: RoutingPlan, tiles: TileSpec, ranks: tuple[int, ...] | None = None) -> TaskGraph:
    """The deduplicated forward task graph of ``ranks`` (default: every rank)."""
    ranks, sel = select_ranks(plan.par.ep, ranks)
    d = make_dedup_layout(plan, tiles)
    dl = DedupLowering(Lowering(layout=d.base, events=dedup_events(d), sel=sel), d,
                       tiles.partial_dtype.itemsize)
    builder = GraphBuilder(plan.par.ep, ranks)
    for make in _PHASES:
        builder.add(make(dl))
    every = DedupLowering(Lowering(d.base, dl.low.events, np.ones(plan.par.ep, bool)), d, dl.partial_size)
    signals = [_expand(every), _gemm_down(every), _combine(every)]
    shared_out = signals_per_token_tile(_shared_down(DedupLowering(dl.low.only(0), d, dl.partial_size)),
                                        dl.low, DedupEvent.OUT)
    for r in ranks:
        builder.set_events(r, dedup_thresholds(dl, r, signals, shared_out))
    return builder.freeze(dtype=plan.moe.dtype, events=dl.low.events)


def dedup_thresholds(dl: DedupLowering, rank: int, signals: list[TaskBlock],
                     shared_out: np.ndarray) -> np.ndarray:
    """Thresholds of ``rank``'s events: the number of signals each receives from the
    EXPAND, GEMM_DOWN and COMBINE tasks of every rank (``signals``), the rest one per
    producer as in the per-expert forward."""
    base, d, ev = dl.d.base, dl.d, dl.low.events
    moe, count = base.plan.moe, ev.count(rank)
    got = np.zeros(count, np.int64)
    for blk in signals:
        mine = blk.sig_rank == rank
        got += np.bincount(blk.sig_event[mine], minlength=count)
    out = got.copy()
    lo = ev.offset[rank]
    nb, npieces = int(base.blocks.count[rank]), int(d.pieces.per_dst[rank])
    mine = base.blocks.rank == rank
    out[lo[DedupEvent.H]:lo[DedupEvent.H] + nb] = ntiles(2 * moe.ffn, base.tiles)
    out[lo[DedupEvent.A]:lo[DedupEvent.A] + nb] = ceil_div(base.blocks.row1[mine] - base.blocks.row0[mine],
                                                           base.tiles.rows)
    for cat in (DedupEvent.LANDED, DedupEvent.PART):
        out[lo[cat]:lo[cat] + npieces] = 1
    tt = base.token_tiles
    out[lo[DedupEvent.OUT]:lo[DedupEvent.OUT] + tt] += shared_out
    out[lo[DedupEvent.SH]:lo[DedupEvent.SH] + base.shared_blocks] = ntiles(2 * moe.shared_ffn, base.tiles)
    out[lo[DedupEvent.SA]:lo[DedupEvent.SA] + base.shared_blocks] = ceil_div(shared_block_rows(base),
                                                                             base.tiles.rows)
    out[lo[DedupEvent.PERM]:lo[DedupEvent.PERM] + int(d.pieces.per_src[rank])] = 1
    return out


# ------------------------------------------------------------------ source side

def _row_bytes(dl: DedupLowering, i: np.ndarray, size: int) -> dict:
    p = dl.d.pieces
    nbytes = p.rows[i] * dl.d.base.plan.moe.hidden * size
    return {"bytes": 2 * nbytes, "link_bytes": np.where(p.src[i] != p.dst[i], nbytes, 0)}


def _permute(dl: DedupLowering) -> TaskBlock:
    p, low = dl.d.pieces, dl.low
    i = np.flatnonzero(low.sel[p.src])
    h = dl.d.base.plan.moe.hidden
    return task_block(TaskKind.PERMUTE, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                      bytes=2 * p.rows[i] * h * low.esize,
                      sig_event=low.events.base(p.src[i], DedupEvent.PERM) + p.local[i])


def _dispatch(dl: DedupLowering) -> TaskBlock:
    p, ev = dl.d.pieces, dl.low.events
    i = np.flatnonzero(dl.low.sel[p.src])
    return task_block(TaskKind.DISPATCH, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                      peer=p.dst[i], dst_row0=p.recv_row0[i], sig_rank=p.dst[i],
                      wait=ev.base(p.src[i], DedupEvent.PERM) + p.local[i],
                      sig_event=ev.base(p.dst[i], DedupEvent.LANDED) + p.rlocal[i],
                      **_row_bytes(dl, i, dl.low.esize))


def _partial_sum(dl: DedupLowering) -> TaskBlock:
    """One task per token tile; reads one partial per (token, rank) it reached."""
    low, pairs = dl.low, dl.d.pairs
    base = dl.d.base
    rank, t, r0, r1 = _token_tiles(low)
    h, rows = base.plan.moe.hidden, base.tiles.rows
    terms = np.bincount(pairs.src * base.token_tiles + pairs.token // rows,
                        minlength=base.plan.par.ep * base.token_tiles)[rank * base.token_tiles + t]
    m = r1 - r0
    shared = m if base.shared_blocks else 0
    return task_block(TaskKind.PARTIAL_SUM, rank, r0, r1, col1=np.full(len(rank), h),
                      flops=(terms + shared) * h,
                      bytes=(terms * dl.partial_size + (shared + m) * low.esize) * h,
                      wait=low.events.base(rank, DedupEvent.OUT) + t)


def _token_tiles(low: Lowering) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    layout = low.layout
    tpr, rows = layout.plan.par.tokens_per_rank, layout.tiles.rows
    rank, t = expand(np.where(low.sel, layout.token_tiles, 0))
    return rank, t, t * rows, np.minimum((t + 1) * rows, tpr)


# ------------------------------------------------------------------ destination side

def _expand(dl: DedupLowering) -> TaskBlock:
    p, ev, d = dl.d.pieces, dl.low.events, dl.d
    i = np.flatnonzero(dl.low.sel[p.dst])
    feed = np.flatnonzero(dl.low.sel[p.dst[d.feed_piece]])
    copies = _copies(dl)[i]
    h = d.base.plan.moe.hidden
    return task_block(TaskKind.EXPAND, p.dst[i], p.recv_row0[i], p.recv_row0[i] + p.rows[i],
                      bytes=(p.rows[i] + copies) * h * dl.low.esize,
                      wait=ev.base(p.dst[i], DedupEvent.LANDED) + p.rlocal[i],
                      sig_count=np.bincount(np.searchsorted(i, d.feed_piece[feed]), minlength=len(i)),
                      sig_rank=p.dst[d.feed_piece[feed]],
                      sig_event=ev.base(p.dst[d.feed_piece[feed]], DedupEvent.ROWS)
                      + d.base.blocks.local[d.feed_block[feed]])


def _copies(dl: DedupLowering) -> np.ndarray:
    """[pieces] expert rows each piece's pairs expand to."""
    pairs, p = dl.d.pairs, dl.d.pieces
    per_pair = (pairs.slot_row >= 0).sum(axis=1)
    pair_piece = np.repeat(np.arange(len(p.src)), p.rows)  # pieces list pairs in (src, dst, token) order
    return np.bincount(pair_piece, weights=per_pair, minlength=len(p.src)).astype(np.int64)


def _gemm_up(dl: DedupLowering) -> TaskBlock:
    moe = dl.d.base.plan.moe
    return block_gemm(TaskKind.GEMM_UP, dl.low, 2 * moe.ffn, moe.hidden, DedupEvent.ROWS, DedupEvent.H)


def _swiglu(dl: DedupLowering) -> TaskBlock:
    b, ev = dl.d.base.blocks, dl.low.events
    i, r0, r1 = block_chunks(dl.low)
    return elementwise_chunks(TaskKind.SWIGLU, dl.low, b.rank[i], r0, r1, dl.d.base.plan.moe.ffn,
                              passes=3, flops=5.0, expert=b.expert[i],
                              wait=ev.base(b.rank[i], DedupEvent.H) + b.local[i],
                              sig_event=ev.base(b.rank[i], DedupEvent.A) + b.local[i])


def _gemm_down(dl: DedupLowering) -> TaskBlock:
    """GEMM_DOWN tiles, each signalling the RED event of every piece fed by its block."""
    d, ev = dl.d, dl.low.events
    moe = d.base.plan.moe
    blk = block_gemm(TaskKind.GEMM_DOWN, dl.low, moe.hidden, moe.ffn, DedupEvent.A, DedupEvent.H)
    block = _block_of(dl, blk)
    by_block = np.argsort(d.feed_block, kind="stable")
    first = np.searchsorted(d.feed_block[by_block], block, side="left")
    n = np.searchsorted(d.feed_block[by_block], block, side="right") - first
    parent, j = expand(n)
    piece = d.feed_piece[by_block[first[parent] + j]]
    blk.sig_count = n
    blk.sig_rank = d.pieces.dst[piece]
    blk.sig_event = ev.base(d.pieces.dst[piece], DedupEvent.RED) + d.pieces.rlocal[piece]
    return blk


def _block_of(dl: DedupLowering, blk: TaskBlock) -> np.ndarray:
    """Global block id of each task of ``blk`` (tasks over whole GEMM blocks)."""
    b = dl.d.base.blocks
    span = int(max(dl.d.base.plan.recv_offsets[:, -1].max(), 1)) + 1
    return np.searchsorted(b.rank * span + b.row0, blk.rank * span + blk.row0, side="right") - 1


def _partial_reduce(dl: DedupLowering) -> TaskBlock:
    p, ev = dl.d.pieces, dl.low.events
    i = np.flatnonzero(dl.low.sel[p.dst])
    copies = _copies(dl)[i]
    h = dl.d.base.plan.moe.hidden
    return task_block(TaskKind.PARTIAL_REDUCE, p.dst[i], p.recv_row0[i], p.recv_row0[i] + p.rows[i],
                      flops=2.0 * copies * h, bytes=(copies * dl.low.esize + p.rows[i] * dl.partial_size) * h,
                      wait=ev.base(p.dst[i], DedupEvent.RED) + p.rlocal[i],
                      sig_event=ev.base(p.dst[i], DedupEvent.PART) + p.rlocal[i])


def _combine(dl: DedupLowering) -> TaskBlock:
    """Partial rows back to the source; each signals the source token tiles it carries."""
    d, ev = dl.d, dl.low.events
    p, pairs, rows = d.pieces, d.pairs, d.base.tiles.rows
    i = np.flatnonzero(dl.low.sel[p.dst])
    pair_piece = np.repeat(np.arange(len(p.src)), p.rows)
    tt = d.base.token_tiles
    key = np.unique(pair_piece * tt + pairs.token // rows)
    piece, tile = key // tt, key % tt
    keep = dl.low.sel[p.dst[piece]]
    piece, tile = piece[keep], tile[keep]
    return task_block(TaskKind.COMBINE, p.dst[i], p.recv_row0[i], p.recv_row0[i] + p.rows[i],
                      peer=p.src[i], dst_row0=p.send_row0[i],
                      wait=ev.base(p.dst[i], DedupEvent.PART) + p.rlocal[i],
                      sig_count=np.bincount(np.searchsorted(i, piece), minlength=len(i)),
                      sig_rank=p.src[piece], sig_event=ev.base(p.src[piece], DedupEvent.OUT) + tile,
                      **_row_bytes(dl, i, dl.partial_size))


# ------------------------------------------------------------------ shared expert

def _shared_up(dl: DedupLowering) -> TaskBlock:
    moe = dl.d.base.plan.moe
    return shared_gemm(TaskKind.SHARED_UP, dl.low, 2 * moe.shared_ffn, moe.hidden, None, DedupEvent.SH)


def _shared_swiglu(dl: DedupLowering) -> TaskBlock:
    low = dl.low
    rank, b, c0, c1 = shared_chunks(low)
    return elementwise_chunks(TaskKind.SHARED_SWIGLU, low, rank, c0, c1, dl.d.base.plan.moe.shared_ffn,
                              passes=3, flops=5.0, wait=low.events.base(rank, DedupEvent.SH) + b,
                              sig_event=low.events.base(rank, DedupEvent.SA) + b)


def _shared_down(dl: DedupLowering) -> TaskBlock:
    moe = dl.d.base.plan.moe
    blk = shared_gemm(TaskKind.SHARED_DOWN, dl.low, moe.hidden, moe.shared_ffn, DedupEvent.SA, None)
    return signal_token_tiles(blk, dl.low, DedupEvent.OUT)


_PHASES = (_permute, _dispatch, _expand, _gemm_up, _swiglu, _gemm_down, _partial_reduce, _combine,
           _shared_up, _shared_swiglu, _shared_down, _partial_sum)

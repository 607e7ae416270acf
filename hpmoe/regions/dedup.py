"""Rank-deduplicated forward lowering (``DispatchMode.PER_RANK``), and its
hierarchical form (``DispatchMode.PER_NODE``).

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

Under ``PER_NODE`` with ``ParallelSpec.nodes`` > 1, a token's rows to ranks of its own
node go as above; to another node it crosses once (a hop) to that node's relay rank,
which forwards it over the fast tier and sums the node's partials before one row
crosses back:
  PERMUTE         also gathers the hop rows (after the delivered rows of the send buffer);
  HOP_DISPATCH    one per hop piece: put them into the relay's ``hrecv`` rows;
  RELAY_PACK      on the relay, one per forwarded piece: gather its ``hrecv`` rows into
                  send rows, after every hop piece they came in; its DISPATCH follows;
  COMBINE         of a forwarded piece: the partials go back to the relay;
  NODE_REDUCE     on the relay, one per hop piece received: fp32 sum of each token's
                  partials from the node's ranks, rank order, cast to the wire dtype;
  HOP_COMBINE     one per hop piece: put the node partials back to the source;
  PARTIAL_SUM     sums same-node rank partials and node partials in rank order of
                  (rank, first rank of the node) (``refs.rank_partials_sum``).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from ..ir.events import EventLayout
from ..ir.graph import GraphBuilder, TaskBlock, TaskGraph, TaskKind
from ..routing import RoutingPlan
from ..spec import DispatchMode, TileSpec
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

PER_RANK_KINDS = frozenset({TaskKind.EXPAND, TaskKind.PARTIAL_REDUCE, TaskKind.PARTIAL_SUM,
                            TaskKind.HOP_DISPATCH, TaskKind.RELAY_PACK, TaskKind.NODE_REDUCE,
                            TaskKind.HOP_COMBINE, TaskKind.ROUTER_COMBINE, TaskKind.HOP_ROUTER_COMBINE})
"""Task kinds only the per-rank (and per-node) forward has."""


class DedupEvent(enum.IntEnum):
    """Event categories of a rank: ROWS, H, A one per GEMM block; LANDED, RED, PART
    one per piece received (rows arrived; every expert output of its rows ready; its
    partials written); OUT one per token tile; SH, SA one per shared block; PERM one
    per piece sent (delivery pieces, then hop pieces).  Under ``PER_NODE``: HOP one
    per delivery piece sent (every hop piece a forwarded one gathers from arrived);
    HRED, HDONE one per hop piece received (every partial of its rows is back; its
    node partials written)."""

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
    HOP = 10
    HRED = 11
    HDONE = 12


@dataclass(frozen=True)
class Pairs:
    """Every (token, destination rank) row as it is delivered, sorted by (src, dst,
    fwd, origin, token).  src: the rank that puts the row into dst's ``drecv`` (the
    token's own rank ``origin``, or under ``PER_NODE`` the relay of dst's node when
    ``fwd``); hop: the hop that brought a forwarded row to the relay (-1: none).
    send_row: row in src's send buffer (by dst, fwd, origin, token); recv_row: row in
    dst's ``drecv`` (by src, fwd, origin, token); slot_row: [P, k] per-expert receive
    row on dst of each top-k slot (-1: the slot's expert is elsewhere)."""

    src: np.ndarray
    dst: np.ndarray
    token: np.ndarray
    origin: np.ndarray
    fwd: np.ndarray
    hop: np.ndarray
    send_row: np.ndarray
    recv_row: np.ndarray
    slot_row: np.ndarray
    per_src: np.ndarray  # [ep]
    per_dst: np.ndarray  # [ep]


@dataclass(frozen=True)
class Hops:
    """Under ``PER_NODE``: one hop per (token, destination node other than its own),
    sorted by (origin, relay, token).  relay: the node's rank the row crosses to (the
    token's only destination rank there, else the rank with the origin's index in its
    node).  send_row: row in origin's send buffer (after its delivered rows, by relay,
    token); recv_row: row in relay's ``hrecv`` (by origin, token)."""

    origin: np.ndarray
    relay: np.ndarray
    token: np.ndarray
    send_row: np.ndarray
    recv_row: np.ndarray
    per_src: np.ndarray  # [ep]
    per_dst: np.ndarray  # [ep]


@dataclass(frozen=True)
class DedupPieces:
    """Pieces of at most ``tiles.rows`` consecutive rows of one (src, dst, fwd): the
    unit of one put.  ``local`` is the id among the source's pieces, ``rlocal`` among
    the destination's."""

    src: np.ndarray
    dst: np.ndarray
    fwd: np.ndarray
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
    rows that travel and their pieces, which blocks each received piece feeds
    (``feed_piece``/``feed_block``: distinct pairs, sorted by piece), and under
    ``PER_NODE`` the hops, their pieces (``local`` after the source's delivery
    pieces, ``send_row0`` after its delivered rows) and which forwarded piece each hop
    piece feeds (``hop_feed``/``fwd_feed``: distinct pairs, sorted by hop piece)."""

    base: Layout
    pairs: Pairs
    pieces: DedupPieces
    feed_piece: np.ndarray
    feed_block: np.ndarray
    hops: Hops
    hop_pieces: DedupPieces
    hop_feed: np.ndarray
    fwd_feed: np.ndarray

    @property
    def send_rows(self) -> np.ndarray:
        """[ep] rows of each rank's send buffer (and ``pcomb``): delivered rows, then hops."""
        return self.pairs.per_src + self.hops.per_src

    @functools.cached_property
    def piece_copies(self) -> np.ndarray:
        """[pieces] expert rows each piece's pairs expand to (derived once)."""
        per_pair = (self.pairs.slot_row >= 0).sum(axis=1)
        return np.bincount(pair_pieces(self.pieces), weights=per_pair,
                           minlength=len(self.pieces.src)).astype(np.int64)


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


def _rank_pairs(plan: RoutingPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(origin, dst, token, slot_row) of every distinct (token, destination rank),
    sorted by (origin, dst, token)."""
    ep, tpr, k = plan.par.ep, plan.par.tokens_per_rank, plan.moe.top_k
    src, flat, dst, recv = slot_rows(plan)
    uniq, inv = np.unique((src * ep + dst) * tpr + flat // k, return_inverse=True)
    slot_row = np.full((len(uniq), k), -1, np.int64)
    slot_row[inv, flat % k] = recv
    return uniq // (ep * tpr), (uniq // tpr) % ep, uniq % tpr, slot_row


def make_hops(plan: RoutingPlan, origin: np.ndarray, dst: np.ndarray, token: np.ndarray,
              cross: np.ndarray) -> tuple[Hops, np.ndarray]:
    """(the hops of the rank pairs (origin, dst, token) that ``cross`` nodes, each
    pair's hop or -1); send rows count from 0 (the caller offsets them)."""
    ep, tpr, rpn = plan.par.ep, plan.par.tokens_per_rank, plan.par.ranks_per_node
    nodes = plan.par.nodes
    cross = np.flatnonzero(cross)
    key, inv, count = np.unique((origin[cross] * nodes + dst[cross] // rpn) * tpr + token[cross],
                                return_inverse=True, return_counts=True)
    h_origin, h_node, h_token = key // (nodes * tpr), (key // tpr) % nodes, key % tpr
    only = np.zeros(len(key), np.int64)
    only[inv] = dst[cross]
    relay = np.where(count == 1, only, h_node * rpn + h_origin % rpn)
    order = np.lexsort((h_token, relay, h_origin))
    rank_of = np.empty(len(key), np.int64)
    rank_of[order] = np.arange(len(key))
    hop = np.full(len(origin), -1, np.int64)
    hop[cross] = rank_of[inv]
    h_origin, relay, h_token = h_origin[order], relay[order], h_token[order]
    per_src, per_dst = np.bincount(h_origin, minlength=ep), np.bincount(relay, minlength=ep)
    by_relay = np.lexsort((h_token, h_origin, relay))
    recv_row = np.empty(len(key), np.int64)
    recv_row[by_relay] = np.arange(len(key)) - exclusive_cumsum(per_dst)[relay[by_relay]]
    send_row = np.arange(len(key)) - exclusive_cumsum(per_src)[h_origin]
    return Hops(origin=h_origin, relay=relay, token=h_token, send_row=send_row, recv_row=recv_row,
                per_src=per_src, per_dst=per_dst), hop


def make_pairs(plan: RoutingPlan, hierarchical: bool = False) -> tuple[Pairs, Hops]:
    """The delivered rows and, ``hierarchical``, the hops between nodes (``PER_NODE``)."""
    ep = plan.par.ep
    origin, dst, token, slot_row = _rank_pairs(plan)
    if not hierarchical or plan.par.nodes == 1:
        cross = np.zeros(len(origin), bool)
    else:
        cross = origin // plan.par.ranks_per_node != dst // plan.par.ranks_per_node
    hops, hop = make_hops(plan, origin, dst, token, cross)
    src = origin.copy()
    src[cross] = hops.relay[hop[cross]]
    order = np.lexsort((token, origin, cross, dst, src))
    src, dst, token, origin, cross, hop, slot_row = (a[order] for a in (src, dst, token, origin, cross,
                                                                         hop, slot_row))
    per_src, per_dst = np.bincount(src, minlength=ep), np.bincount(dst, minlength=ep)
    by_dst = np.lexsort((token, origin, cross, src, dst))
    recv_row = np.empty(len(src), np.int64)
    recv_row[by_dst] = np.arange(len(src)) - exclusive_cumsum(per_dst)[dst[by_dst]]
    hops = replace(hops, send_row=hops.send_row + per_src[hops.origin])
    pairs = Pairs(src=src, dst=dst, token=token, origin=origin, fwd=cross, hop=hop,
                  send_row=np.arange(len(src)) - exclusive_cumsum(per_src)[src], recv_row=recv_row,
                  slot_row=slot_row, per_src=per_src, per_dst=per_dst)
    return pairs, hops


def dedup_factor(plan: RoutingPlan) -> float:
    """Rows crossing ranks with one row per (token, expert) over rows crossing with
    one row per (token, destination rank); 1.0 when nothing crosses."""
    src, _, dst, _ = slot_rows(plan)
    origin, pdst, _, _ = _rank_pairs(plan)
    remote = int((src != dst).sum())
    dedup = int((origin != pdst).sum())
    return remote / dedup if dedup else 1.0


def make_pieces(src: np.ndarray, dst: np.ndarray, fwd: np.ndarray, ep: int, rows: int) -> DedupPieces:
    """Pieces of rows sorted by (src, dst, fwd): sent by (dst, fwd), received by (src, fwd)."""
    cnt = np.bincount((src * ep + dst) * 2 + fwd, minlength=ep * ep * 2).reshape(ep, ep, 2)
    seg, j = expand(ceil_div(cnt, rows).ravel())
    s, d, f = seg // (2 * ep), (seg // 2) % ep, seg % 2
    n = np.minimum(rows, cnt[s, d, f] - j * rows)
    per_src, per_dst = np.bincount(s, minlength=ep), np.bincount(d, minlength=ep)
    by_dst = np.argsort(d, kind="stable")
    rlocal = np.empty(len(s), np.int64)
    rlocal[by_dst] = np.arange(len(s)) - exclusive_cumsum(per_dst)[d[by_dst]]
    sent = exclusive_cumsum(cnt.reshape(ep, 2 * ep), axis=1).reshape(ep, ep, 2)
    got = exclusive_cumsum(cnt.transpose(1, 0, 2).reshape(ep, 2 * ep), axis=1).reshape(ep, ep, 2)
    return DedupPieces(src=s, dst=d, fwd=f.astype(bool), send_row0=sent[s, d, f] + j * rows,
                       recv_row0=got[d, s, f] + j * rows, rows=n,
                       local=np.arange(len(s)) - exclusive_cumsum(per_src)[s], rlocal=rlocal,
                       per_src=per_src, per_dst=per_dst)


def _feeds(base: Layout, pairs: Pairs, pieces: DedupPieces) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (received piece, GEMM block) pairs: a piece's rows are expanded into
    the block, sorted by piece."""
    pair, j = np.nonzero(pairs.slot_row >= 0)
    row = pairs.slot_row[pair, j]
    b = base.blocks
    span = int(max(base.plan.recv_offsets[:, -1].max(), 1)) + 1
    block = np.searchsorted(b.rank * span + b.row0, pairs.dst[pair] * span + row, side="right") - 1
    piece = pair_pieces(pieces)[pair]
    key = np.unique(piece * max(len(b.rank), 1) + block)
    return key // max(len(b.rank), 1), key % max(len(b.rank), 1)


def pair_pieces(pieces: DedupPieces) -> np.ndarray:
    """[rows] the piece of every row (pieces list their rows in order)."""
    return np.repeat(np.arange(len(pieces.src)), pieces.rows)


def _hop_feeds(pairs: Pairs, pieces: DedupPieces, hop_pieces: DedupPieces) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (hop piece, forwarded delivery piece) pairs, sorted by hop piece."""
    fwd = np.flatnonzero(pairs.fwd)
    n = max(len(pieces.src), 1)
    key = np.unique(pair_pieces(hop_pieces)[pairs.hop[fwd]] * n + pair_pieces(pieces)[fwd])
    return key // n, key % n


def make_dedup_layout(plan: RoutingPlan, tiles: TileSpec) -> DedupLayout:
    """Everything the deduplicated lowering needs, for every rank (a pure function of the plan)."""
    ep = plan.par.ep
    base = make_layout(plan, tiles)
    pairs, hops = make_pairs(plan, tiles.dispatch is DispatchMode.PER_NODE)
    pieces = make_pieces(pairs.src, pairs.dst, pairs.fwd.astype(np.int64), ep, tiles.rows)
    hp = make_pieces(hops.origin, hops.relay, np.zeros(len(hops.origin), np.int64), ep, tiles.rows)
    hp = replace(hp, send_row0=hp.send_row0 + pairs.per_src[hp.src], local=hp.local + pieces.per_src[hp.src])
    feed_piece, feed_block = _feeds(base, pairs, pieces)
    hop_feed, fwd_feed = _hop_feeds(pairs, pieces, hp)
    return DedupLayout(base=base, pairs=pairs, pieces=pieces, feed_piece=feed_piece, feed_block=feed_block,
                       hops=hops, hop_pieces=hp, hop_feed=hop_feed, fwd_feed=fwd_feed)


def dedup_events(d: DedupLayout) -> EventLayout:
    base, ep = d.base, d.base.plan.par.ep
    nb, recv, hops = base.blocks.count, d.pieces.per_dst, d.hop_pieces.per_dst

    def full(n: int) -> np.ndarray:
        return np.full(ep, n, np.int64)

    sizes = np.stack([nb, nb, nb, recv, recv, recv, full(base.token_tiles), full(base.shared_blocks),
                      full(base.shared_blocks), d.pieces.per_src + d.hop_pieces.per_src, d.pieces.per_src,
                      hops, hops], axis=1)
    return EventLayout.from_sizes(DedupEvent, sizes)


@dataclass(frozen=True)
class DedupLowering:
    """A ``Lowering`` over the per-expert layout plus the deduplicated layout.  The
    builders that move rows (permute, puts, relays, partial sum) name their events
    through ``names`` (an event enum with PERM, HOP, LANDED, PART, HRED, HDONE, OUT
    members) and their kinds through ``kinds`` (forward kind -> this region's), so the
    backward lowering reuses them."""

    low: Lowering
    d: DedupLayout
    partial_size: int  # bytes per element of the partials on the wire
    names: type[enum.IntEnum] = DedupEvent
    kinds: Mapping[TaskKind, TaskKind] = field(default_factory=dict)

    def kind(self, k: TaskKind) -> TaskKind:
        return self.kinds.get(k, k)


def lower_dedup(plan: RoutingPlan, tiles: TileSpec, ranks: tuple[int, ...] | None = None,
                layout: DedupLayout | None = None) -> TaskGraph:
    """The deduplicated forward task graph of ``ranks`` (default: every rank); ``layout``:
    ``make_dedup_layout(plan, tiles)`` when the caller has it already."""
    ranks, sel = select_ranks(plan.par.ep, ranks)
    d = layout or make_dedup_layout(plan, tiles)
    dl = DedupLowering(Lowering(layout=d.base, events=dedup_events(d), sel=sel), d,
                       tiles.partial_dtype.itemsize)
    builder = GraphBuilder(plan.par.ep, ranks)
    for make in _PHASES:
        builder.add(make(dl))
    every = DedupLowering(Lowering(d.base, dl.low.events, np.ones(plan.par.ep, bool)), d, dl.partial_size)
    signals = [make(every) for make in (_expand, _gemm_down, _combine, _hop_dispatch, _hop_combine)]
    shared_out = signals_per_token_tile(_shared_down(DedupLowering(dl.low.only(0), d, dl.partial_size)),
                                        dl.low, DedupEvent.OUT)
    for r in ranks:
        builder.set_events(r, dedup_thresholds(dl, r, signals, shared_out))
    return builder.freeze(dtype=plan.moe.dtype, events=dl.low.events, nodes=plan.par.nodes)


def dedup_thresholds(dl: DedupLowering, rank: int, signals: list[TaskBlock],
                     shared_out: np.ndarray) -> np.ndarray:
    """Thresholds of ``rank``'s events: the number of signals each receives from the
    EXPAND, GEMM_DOWN, COMBINE, HOP_DISPATCH and HOP_COMBINE tasks of every rank
    (``signals``), the rest one per producer as in the per-expert forward."""
    base, d, ev = dl.d.base, dl.d, dl.low.events
    moe, count = base.plan.moe, ev.count(rank)
    got = np.zeros(count, np.int64)
    for blk in signals:
        mine = blk.sig_rank == rank
        got += np.bincount(blk.sig_event[mine], minlength=count)
    out = got.copy()
    lo = ev.offset[rank]

    def fill(cat: DedupEvent, n: int, value: np.ndarray | int) -> None:
        out[lo[cat]:lo[cat] + n] = value

    nb, npieces = int(base.blocks.count[rank]), int(d.pieces.per_dst[rank])
    nhops = int(d.hop_pieces.per_dst[rank])
    mine = base.blocks.rank == rank
    fill(DedupEvent.H, nb, ntiles(2 * moe.ffn, base.tiles))
    fill(DedupEvent.A, nb, ceil_div(base.blocks.row1[mine] - base.blocks.row0[mine], base.tiles.rows))
    fill(DedupEvent.LANDED, npieces, 1)
    fill(DedupEvent.PART, npieces, 1)
    fill(DedupEvent.HDONE, nhops, 1)
    out[lo[DedupEvent.OUT]:lo[DedupEvent.OUT] + base.token_tiles] += shared_out
    fill(DedupEvent.SH, base.shared_blocks, ntiles(2 * moe.shared_ffn, base.tiles))
    fill(DedupEvent.SA, base.shared_blocks, ceil_div(shared_block_rows(base), base.tiles.rows))
    fill(DedupEvent.PERM, int(d.pieces.per_src[rank] + d.hop_pieces.per_src[rank]), 1)
    return out


# ------------------------------------------------------------------ source side

def _put_bytes(p: DedupPieces, i: np.ndarray, row_bytes: int) -> dict:
    """Work columns of puts of pieces ``i``: each row read and written once; on the
    link when source and destination differ."""
    nbytes = p.rows[i] * row_bytes
    return {"bytes": 2 * nbytes, "link_bytes": np.where(p.src[i] != p.dst[i], nbytes, 0)}


def _permute(dl: DedupLowering) -> TaskBlock:
    """Gather x rows of every piece a rank sends of its own tokens (delivered or hops)."""
    p, hp, low = dl.d.pieces, dl.d.hop_pieces, dl.low
    i, j = np.flatnonzero(low.sel[p.src] & ~p.fwd), np.flatnonzero(low.sel[hp.src])
    rank, row0 = np.concatenate([p.src[i], hp.src[j]]), np.concatenate([p.send_row0[i], hp.send_row0[j]])
    rows, local = np.concatenate([p.rows[i], hp.rows[j]]), np.concatenate([p.local[i], hp.local[j]])
    return task_block(dl.kind(TaskKind.PERMUTE), rank, row0, row0 + rows,
                      bytes=2 * rows * dl.d.base.plan.moe.hidden * low.esize,
                      sig_event=low.events.base(rank, dl.names.PERM) + local)


def _hop_dispatch(dl: DedupLowering) -> TaskBlock:
    """Hop pieces to the relay's ``hrecv``; each signals the HOP event of every
    forwarded piece its rows feed."""
    d, ev = dl.d, dl.low.events
    hp, p = d.hop_pieces, d.pieces
    i = np.flatnonzero(dl.low.sel[hp.src])
    feed = np.flatnonzero(dl.low.sel[hp.src[d.hop_feed]])
    fp = d.fwd_feed[feed]
    return task_block(TaskKind.HOP_DISPATCH, hp.src[i], hp.send_row0[i], hp.send_row0[i] + hp.rows[i],
                      peer=hp.dst[i], dst_row0=hp.recv_row0[i],
                      wait=ev.base(hp.src[i], dl.names.PERM) + hp.local[i],
                      sig_count=np.bincount(np.searchsorted(i, d.hop_feed[feed]), minlength=len(i)),
                      sig_rank=p.src[fp], sig_event=ev.base(p.src[fp], dl.names.HOP) + p.local[fp],
                      **_put_bytes(hp, i, dl.d.base.plan.moe.hidden * dl.low.esize))


def _relay_pack(dl: DedupLowering) -> TaskBlock:
    """On a relay: gather the ``hrecv`` rows of each piece it forwards into its send rows."""
    p, ev = dl.d.pieces, dl.low.events
    i = np.flatnonzero(dl.low.sel[p.src] & p.fwd)
    return task_block(TaskKind.RELAY_PACK, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                      bytes=2 * p.rows[i] * dl.d.base.plan.moe.hidden * dl.low.esize,
                      wait=ev.base(p.src[i], dl.names.HOP) + p.local[i],
                      sig_event=ev.base(p.src[i], dl.names.PERM) + p.local[i])


def _dispatch(dl: DedupLowering) -> TaskBlock:
    p, ev = dl.d.pieces, dl.low.events
    i = np.flatnonzero(dl.low.sel[p.src])
    return task_block(dl.kind(TaskKind.DISPATCH), p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                      peer=p.dst[i], dst_row0=p.recv_row0[i], sig_rank=p.dst[i],
                      wait=ev.base(p.src[i], dl.names.PERM) + p.local[i],
                      sig_event=ev.base(p.dst[i], dl.names.LANDED) + p.rlocal[i],
                      **_put_bytes(p, i, dl.d.base.plan.moe.hidden * dl.low.esize))


def _partial_sum(dl: DedupLowering) -> TaskBlock:
    """One task per token tile; reads one partial per (token, same-node rank it
    reached) and per (token, other node it reached)."""
    low, pairs, hops = dl.low, dl.d.pairs, dl.d.hops
    base = dl.d.base
    rank, t, r0, r1 = _token_tiles(low)
    h, rows, tt = base.plan.moe.hidden, base.tiles.rows, base.token_tiles
    direct = ~pairs.fwd
    key = np.concatenate([pairs.origin[direct] * tt + pairs.token[direct] // rows,
                          hops.origin * tt + hops.token // rows])
    terms = np.bincount(key, minlength=base.plan.par.ep * tt)[rank * tt + t]
    m = r1 - r0
    shared = m if base.shared_blocks else 0
    return task_block(TaskKind.PARTIAL_SUM, rank, r0, r1, col1=np.full(len(rank), h),
                      flops=(terms + shared) * h,
                      bytes=(terms * dl.partial_size + (shared + m) * low.esize) * h,
                      wait=low.events.base(rank, dl.names.OUT) + t)


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
    copies = dl.d.piece_copies[i]
    h = d.base.plan.moe.hidden
    return task_block(TaskKind.EXPAND, p.dst[i], p.recv_row0[i], p.recv_row0[i] + p.rows[i],
                      bytes=(p.rows[i] + copies) * h * dl.low.esize,
                      wait=ev.base(p.dst[i], DedupEvent.LANDED) + p.rlocal[i],
                      sig_count=np.bincount(np.searchsorted(i, d.feed_piece[feed]), minlength=len(i)),
                      sig_rank=p.dst[d.feed_piece[feed]],
                      sig_event=ev.base(p.dst[d.feed_piece[feed]], DedupEvent.ROWS)
                      + d.base.blocks.local[d.feed_block[feed]])


def _gemm_up(dl: DedupLowering) -> TaskBlock:
    moe = dl.d.base.plan.moe
    return block_gemm(TaskKind.GEMM_UP, dl.low, 2 * moe.ffn, moe.hidden, DedupEvent.ROWS, DedupEvent.H)


def _swiglu(dl: DedupLowering) -> TaskBlock:
    b, ev = dl.d.base.blocks, dl.low.events
    i, r0, r1 = block_chunks(dl.low)
    moe = dl.d.base.plan.moe
    return elementwise_chunks(TaskKind.SWIGLU, dl.low, b.rank[i], r0, r1, moe.ffn, passes=3,
                              flops=moe.glu.flops, expert=b.expert[i],
                              wait=ev.base(b.rank[i], DedupEvent.H) + b.local[i],
                              sig_event=ev.base(b.rank[i], DedupEvent.A) + b.local[i])


def _gemm_down(dl: DedupLowering) -> TaskBlock:
    """GEMM_DOWN tiles, each signalling the RED event of every piece fed by its block."""
    d, ev = dl.d, dl.low.events
    moe = d.base.plan.moe
    blk = block_gemm(TaskKind.GEMM_DOWN, dl.low, moe.hidden, moe.ffn, DedupEvent.A, DedupEvent.H)
    return signal_fed_pieces(d, ev, blk, DedupEvent.RED)


def signal_fed_pieces(d: DedupLayout, ev: EventLayout, blk: TaskBlock, category: enum.IntEnum) -> TaskBlock:
    """``blk`` (tiles over whole GEMM blocks) now signals ``category``'s event of every
    received piece its block is fed by."""
    block = _block_of(d, blk)
    by_block = np.argsort(d.feed_block, kind="stable")
    first = np.searchsorted(d.feed_block[by_block], block, side="left")
    n = np.searchsorted(d.feed_block[by_block], block, side="right") - first
    parent, j = expand(n)
    piece = d.feed_piece[by_block[first[parent] + j]]
    blk.sig_count = n
    blk.sig_rank = d.pieces.dst[piece]
    blk.sig_event = ev.base(d.pieces.dst[piece], category) + d.pieces.rlocal[piece]
    return blk


def _block_of(d: DedupLayout, blk: TaskBlock) -> np.ndarray:
    """Global block id of each task of ``blk`` (tasks over whole GEMM blocks)."""
    b = d.base.blocks
    span = int(max(d.base.plan.recv_offsets[:, -1].max(), 1)) + 1
    return np.searchsorted(b.rank * span + b.row0, blk.rank * span + blk.row0, side="right") - 1


def _partial_reduce(dl: DedupLowering) -> TaskBlock:
    p, ev = dl.d.pieces, dl.low.events
    i = np.flatnonzero(dl.low.sel[p.dst])
    copies = dl.d.piece_copies[i]
    h = dl.d.base.plan.moe.hidden
    return task_block(TaskKind.PARTIAL_REDUCE, p.dst[i], p.recv_row0[i], p.recv_row0[i] + p.rows[i],
                      flops=2.0 * copies * h, bytes=(copies * dl.low.esize + p.rows[i] * dl.partial_size) * h,
                      wait=ev.base(p.dst[i], DedupEvent.RED) + p.rlocal[i],
                      sig_event=ev.base(p.dst[i], DedupEvent.PART) + p.rlocal[i])


def _combine(dl: DedupLowering, row_bytes: int | None = None) -> TaskBlock:
    """Partial rows back to the piece's sender: a direct piece signals the source
    token tiles it carries, a forwarded one the relay's HRED event of every hop piece
    its rows came in."""
    d, ev = dl.d, dl.low.events
    p, pairs, hp, rows, tt = d.pieces, d.pairs, d.hop_pieces, d.base.tiles.rows, d.base.token_tiles
    i = np.flatnonzero(dl.low.sel[p.dst])
    direct = ~pairs.fwd
    key = np.unique(pair_pieces(p)[direct] * tt + pairs.token[direct] // rows)
    piece = np.concatenate([key // tt, d.fwd_feed])
    event = np.concatenate([ev.base(p.src[key // tt], dl.names.OUT) + key % tt,
                            ev.base(hp.dst[d.hop_feed], dl.names.HRED) + hp.rlocal[d.hop_feed]])
    order = np.argsort(piece, kind="stable")
    piece, event = piece[order], event[order]
    keep = dl.low.sel[p.dst[piece]]
    piece, event = piece[keep], event[keep]
    return task_block(dl.kind(TaskKind.COMBINE), p.dst[i], p.recv_row0[i], p.recv_row0[i] + p.rows[i],
                      peer=p.src[i], dst_row0=p.send_row0[i],
                      wait=ev.base(p.dst[i], dl.names.PART) + p.rlocal[i],
                      sig_count=np.bincount(np.searchsorted(i, piece), minlength=len(i)),
                      sig_rank=p.src[piece], sig_event=event,
                      **_put_bytes(p, i, row_bytes or d.base.plan.moe.hidden * dl.partial_size))


def _node_reduce(dl: DedupLowering) -> TaskBlock:
    """On a relay, per hop piece received: each token's node partial, the fp32 sum of
    the partials of the node's ranks it reached, in rank order."""
    d, ev = dl.d, dl.low.events
    hp, pairs = d.hop_pieces, d.pairs
    i = np.flatnonzero(dl.low.sel[hp.dst])
    hop_piece = pair_pieces(hp)
    terms = np.bincount(hop_piece[pairs.hop[pairs.fwd]], minlength=len(hp.src))[i]
    h = d.base.plan.moe.hidden
    return task_block(TaskKind.NODE_REDUCE, hp.dst[i], hp.recv_row0[i], hp.recv_row0[i] + hp.rows[i],
                      col1=np.full(len(i), h), flops=terms * h,
                      bytes=(terms + hp.rows[i]) * dl.partial_size * h,
                      wait=ev.base(hp.dst[i], dl.names.HRED) + hp.rlocal[i],
                      sig_event=ev.base(hp.dst[i], dl.names.HDONE) + hp.rlocal[i])


def _hop_combine(dl: DedupLowering, row_bytes: int | None = None) -> TaskBlock:
    """Node partials back across nodes to the source; each signals the token tiles it carries."""
    d, ev = dl.d, dl.low.events
    hp, rows, tt = d.hop_pieces, d.base.tiles.rows, d.base.token_tiles
    i = np.flatnonzero(dl.low.sel[hp.dst])
    key = np.unique(pair_pieces(hp) * tt + d.hops.token // rows)
    piece, tile = key // tt, key % tt
    keep = dl.low.sel[hp.dst[piece]]
    piece, tile = piece[keep], tile[keep]
    return task_block(dl.kind(TaskKind.HOP_COMBINE), hp.dst[i], hp.recv_row0[i], hp.recv_row0[i] + hp.rows[i],
                      peer=hp.src[i], dst_row0=hp.send_row0[i],
                      wait=ev.base(hp.dst[i], dl.names.HDONE) + hp.rlocal[i],
                      sig_count=np.bincount(np.searchsorted(i, piece), minlength=len(i)),
                      sig_rank=hp.src[piece], sig_event=ev.base(hp.src[piece], dl.names.OUT) + tile,
                      **_put_bytes(hp, i, row_bytes or d.base.plan.moe.hidden * dl.partial_size))


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


_PHASES = (_permute, _hop_dispatch, _relay_pack, _dispatch, _expand, _gemm_up, _swiglu, _gemm_down,
           _partial_reduce, _combine, _node_reduce, _hop_combine, _shared_up, _shared_swiglu, _shared_down,
           _partial_sum)

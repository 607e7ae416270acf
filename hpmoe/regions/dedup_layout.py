"""The deduplicated layout (``DispatchMode.PER_RANK`` / ``PER_NODE``): which (token,
destination rank) pairs travel, in which send and receive rows, grouped in pieces, and
under ``PER_NODE`` which of them hop to a relay rank of another node first.  The
deduplicated regions' lowering (``regions.dedup``), kernels and contexts read it; it is
built once per plan and tiles (``make_dedup_layout``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from ..routing import RoutingPlan
from ..spec import DispatchMode, TileSpec
from .layout import Layout, ceil_div, exclusive_cumsum, expand, make_layout


@dataclass(frozen=True)
class _Travelling:
    """Rows that travel, one per ``token`` of rank ``origin``: ``send_row`` in the
    sender's buffer, ``recv_row`` in the receiver's; per_src / per_dst [ep]: rows each
    rank sends / receives."""

    origin: np.ndarray
    token: np.ndarray
    send_row: np.ndarray
    recv_row: np.ndarray
    per_src: np.ndarray
    per_dst: np.ndarray


@dataclass(frozen=True)
class Pairs(_Travelling):
    """Every (token, destination rank) row as it is delivered, sorted by (src, dst,
    fwd, origin, token).  src: the rank that puts the row into dst's ``drecv`` (the
    token's own rank ``origin``, or under ``PER_NODE`` the relay of dst's node when
    ``fwd``); hop: the hop that brought a forwarded row to the relay (-1: none).
    send_row: row in src's send buffer (by dst, fwd, origin, token); recv_row: row in
    dst's ``drecv`` (by src, fwd, origin, token); slot_row: [P, k] per-expert receive
    row on dst of each top-k slot (-1: the slot's expert is elsewhere)."""

    src: np.ndarray
    dst: np.ndarray
    fwd: np.ndarray
    hop: np.ndarray
    slot_row: np.ndarray


@dataclass(frozen=True)
class Hops(_Travelling):
    """Under ``PER_NODE``: one hop per (token, destination node other than its own),
    sorted by (origin, relay, token).  relay: the node's rank the row crosses to (the
    token's only destination rank there, else the rank with the origin's index in its
    node).  send_row: row in origin's send buffer (after its delivered rows, by relay,
    token); recv_row: row in relay's ``hrecv`` (by origin, token)."""

    relay: np.ndarray


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



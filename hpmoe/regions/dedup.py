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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from ..deprecation import deprecated
from ..ir.events import EventLayout, extended
from ..ir.graph import TaskBlock, TaskGraph, TaskKind
from ..routing import RoutingPlan
from ..spec import TileSpec
from .dedup_layout import DedupLayout, DedupPieces, make_dedup_layout, pair_pieces
from .forward import ForwardEvent
from .layout import expand
from .tiles import (
    SHARED_PHASES,
    UP_PHASES,
    Lowering,
    block_gemm,
    lower_graph,
    select_ranks,
    task_block,
    token_tiles,
)

PER_RANK_KINDS = frozenset({TaskKind.EXPAND, TaskKind.PARTIAL_REDUCE, TaskKind.PARTIAL_SUM,
                            TaskKind.HOP_DISPATCH, TaskKind.RELAY_PACK, TaskKind.NODE_REDUCE,
                            TaskKind.HOP_COMBINE, TaskKind.ROUTER_COMBINE, TaskKind.HOP_ROUTER_COMBINE})
"""Task kinds only the per-rank (and per-node) forward has."""


DedupEvent = extended("DedupEvent", __name__, ForwardEvent, ("LANDED", "RED", "PART", "HOP", "HRED", "HDONE"))
"""Event categories of a rank: the per-expert forward's (Y empty here: the GEMM_DOWN tiles
signal the pieces they feed); one per piece received: LANDED (its rows arrived), RED
(every expert output of its rows ready), PART (its partials written); under
``PER_NODE``, HOP one per delivery piece sent (every hop piece a forwarded one gathers
from arrived), HRED and HDONE one per hop piece received (every partial of its rows is
back; its node partials written).  PERM: one per piece sent, delivery pieces then hops."""


def dedup_events(d: DedupLayout) -> EventLayout:
    base = d.base
    nb, recv, hops, sb = base.blocks.count, d.pieces.per_dst, d.hop_pieces.per_dst, base.shared_blocks
    return EventLayout.from_columns(DedupEvent, base.plan.par.ep, [
        nb, nb, nb, 0, base.token_tiles, sb, sb, d.pieces.per_src + d.hop_pieces.per_src,
        recv, recv, recv, d.pieces.per_src, hops, hops])


@dataclass(frozen=True)
class DedupLowering:
    """A ``Lowering`` over the per-expert layout plus the deduplicated layout.  The
    builders that move rows (permute, puts, relays, partial sum) name their events by
    name in the region's enum (``e``: PERM, HOP, LANDED, PART, HRED, HDONE, OUT) and
    their kinds through ``kinds`` (forward kind -> this region's), so the backward
    lowering reuses them."""

    low: Lowering
    d: DedupLayout
    partial_size: int  # bytes per element of the partials on the wire
    kinds: Mapping[TaskKind, TaskKind] = field(default_factory=dict)

    @property
    def e(self) -> type[enum.IntEnum]:
        """The region's event categories."""
        return self.low.events.categories

    def kind(self, k: TaskKind) -> TaskKind:
        return self.kinds.get(k, k)

    @property
    def row_bytes(self) -> int:
        """Bytes of a row the permute and the dispatch move: H elements, 2H where a
        backward's input rows travel beside its dy rows."""
        return self.d.base.plan.moe.hidden * self.low.esize * (2 if self.low.kept.travels else 1)


def lower_dedup(plan: RoutingPlan, tiles: TileSpec, ranks: tuple[int, ...] | None = None,
                layout: DedupLayout | None = None) -> TaskGraph:
    """The deduplicated forward task graph of ``ranks`` (default: every rank); ``layout``:
    ``make_dedup_layout(plan, tiles)`` when the caller has it already."""
    _, sel = select_ranks(plan.par.ep, ranks)
    d = layout or make_dedup_layout(plan, tiles)
    low = Lowering(layout=d.base, events=dedup_events(d), sel=sel)
    size = tiles.partial_dtype.itemsize
    return lower_graph(_PHASES, DedupLowering(low, d, size), DedupLowering(low.every(), d, size), sel,
                       low.events, plan.moe.dtype, plan.par.nodes)


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
                      bytes=2 * rows * dl.row_bytes, sig_event=low.events.base(rank, dl.e.PERM) + local)


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
                      wait=ev.base(hp.src[i], dl.e.PERM) + hp.local[i],
                      sig_count=np.bincount(np.searchsorted(i, d.hop_feed[feed]), minlength=len(i)),
                      sig_rank=p.src[fp], sig_event=ev.base(p.src[fp], dl.e.HOP) + p.local[fp],
                      **_put_bytes(hp, i, dl.row_bytes))


def _relay_pack(dl: DedupLowering) -> TaskBlock:
    """On a relay: gather the ``hrecv`` rows of each piece it forwards into its send rows."""
    p, ev = dl.d.pieces, dl.low.events
    i = np.flatnonzero(dl.low.sel[p.src] & p.fwd)
    return task_block(TaskKind.RELAY_PACK, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                      bytes=2 * p.rows[i] * dl.row_bytes, wait=ev.base(p.src[i], dl.e.HOP) + p.local[i],
                      sig_event=ev.base(p.src[i], dl.e.PERM) + p.local[i])


def _dispatch(dl: DedupLowering) -> TaskBlock:
    p, ev = dl.d.pieces, dl.low.events
    i = np.flatnonzero(dl.low.sel[p.src])
    return task_block(dl.kind(TaskKind.DISPATCH), p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                      peer=p.dst[i], dst_row0=p.recv_row0[i], sig_rank=p.dst[i],
                      wait=ev.base(p.src[i], dl.e.PERM) + p.local[i],
                      sig_event=ev.base(p.dst[i], dl.e.LANDED) + p.rlocal[i],
                      **_put_bytes(p, i, dl.row_bytes))


def _partial_sum(dl: DedupLowering) -> TaskBlock:
    """One task per token tile; reads one partial per (token, same-node rank it
    reached) and per (token, other node it reached)."""
    low, pairs, hops = dl.low, dl.d.pairs, dl.d.hops
    base = dl.d.base
    rank, t, r0, r1 = token_tiles(low)
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
                      wait=low.events.base(rank, dl.e.OUT) + t)


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
    return replace(blk, sig_count=n, sig_rank=d.pieces.dst[piece],
                   sig_event=ev.base(d.pieces.dst[piece], category) + d.pieces.rlocal[piece])


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
    event = np.concatenate([ev.base(p.src[key // tt], dl.e.OUT) + key % tt,
                            ev.base(hp.dst[d.hop_feed], dl.e.HRED) + hp.rlocal[d.hop_feed]])
    order = np.argsort(piece, kind="stable")
    piece, event = piece[order], event[order]
    keep = dl.low.sel[p.dst[piece]]
    return _return_put(dl, TaskKind.COMBINE, p, i, dl.e.PART, piece[keep], event[keep], row_bytes)


def _return_put(dl: DedupLowering, kind: TaskKind, p: DedupPieces, i: np.ndarray, after: enum.IntEnum,
                piece: np.ndarray, event: np.ndarray, row_bytes: int | None) -> TaskBlock:
    """Puts of partial rows back to the sender of the pieces ``p[i]``, each after its
    ``after`` event; ``piece`` (sorted) and ``event``: the source events each signals
    (owned by the piece's sender)."""
    ev = dl.low.events
    return task_block(dl.kind(kind), p.dst[i], p.recv_row0[i], p.recv_row0[i] + p.rows[i],
                      peer=p.src[i], dst_row0=p.send_row0[i], wait=ev.base(p.dst[i], after) + p.rlocal[i],
                      sig_count=np.bincount(np.searchsorted(i, piece), minlength=len(i)),
                      sig_rank=p.src[piece], sig_event=event,
                      **_put_bytes(p, i, row_bytes or dl.d.base.plan.moe.hidden * dl.partial_size))


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
                      wait=ev.base(hp.dst[i], dl.e.HRED) + hp.rlocal[i],
                      sig_event=ev.base(hp.dst[i], dl.e.HDONE) + hp.rlocal[i])


def _hop_combine(dl: DedupLowering, row_bytes: int | None = None) -> TaskBlock:
    """Node partials back across nodes to the source; each signals the token tiles it carries."""
    d, ev = dl.d, dl.low.events
    hp, rows, tt = d.hop_pieces, d.base.tiles.rows, d.base.token_tiles
    i = np.flatnonzero(dl.low.sel[hp.dst])
    key = np.unique(pair_pieces(hp) * tt + d.hops.token // rows)
    piece, tile = key // tt, key % tt
    keep = dl.low.sel[hp.dst[piece]]
    piece, tile = piece[keep], tile[keep]
    return _return_put(dl, TaskKind.HOP_COMBINE, hp, i, dl.e.HDONE, piece,
                       ev.base(hp.src[piece], dl.e.OUT) + tile, row_bytes)


def on_experts(make: Callable[[Lowering], TaskBlock]) -> Callable[[DedupLowering], TaskBlock]:
    """A builder of the per-expert lowering (the experts' phases) on a deduplicated one."""
    return lambda dl: make(dl.low)


_PHASES = (_permute, _hop_dispatch, _relay_pack, _dispatch, _expand, *map(on_experts, UP_PHASES),
           _gemm_down, _partial_reduce, _combine, _node_reduce, _hop_combine, *map(on_experts, SHARED_PHASES),
           _partial_sum)


def dedup_thresholds(dl: DedupLowering, rank: int, signals: object = None, shared_out: object = None
                     ) -> np.ndarray:
    """Deprecated: ``rank``'s thresholds of the deduplicated forward, now counted by the
    lowering (``signals`` and ``shared_out`` are not read)."""
    deprecated("regions.dedup.dedup_thresholds", "lower_dedup(plan, tiles, (rank,)).threshold")
    base = dl.d.base
    return lower_dedup(base.plan, base.tiles, (rank,), layout=dl.d).threshold

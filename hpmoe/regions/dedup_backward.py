"""Backward of the rank-deduplicated forward (``DispatchMode.PER_RANK``): the output
gradient travels once per (token, destination rank) and the input gradient comes back
as one partial row per (token, rank), over the forward's pairs and pieces.

With y = sum_j w_j o_j + shared(x), per rank, in data-flow order:
  GRAD_PERMUTE    one per piece: gather dy rows of (token, destination rank) pairs;
  GRAD_DISPATCH   one per piece: put them into the destination's ``gdrecv`` rows;
  EXPAND          one per received piece: each row times w_j (fp32 math, cast) into the
                  rows of every local expert the token chose, signalling those blocks'
                  GROWS and those experts' GEXP;
  ROUTER_GRAD     one per received piece: dw[t, j] = <dy[t], o_j[t]> in fp32 for the
                  rank's slots, on the expert's rank (o_j stays where it was computed);
  DGRAD_DOWN / SWIGLU_BWD / DGRAD_UP / WGRAD_* / SWIGLU_RECOMPUTE   as in the
                  per-expert backward; DGRAD_UP signals GRED of every piece its block feeds;
  PARTIAL_REDUCE  one per received piece: fp32 sum of the rank's expert input gradients
                  of each pair, slot order, cast to ``tiles.partial_dtype``;
  GRAD_COMBINE    one per piece: put the partial rows back to the source;
  ROUTER_COMBINE  one per piece: put the routing-weight gradients back to the source;
  SHARED_*        the shared experts' backward tiles on the rank's own tokens;
  PARTIAL_SUM     one per token tile: dx = fp32 sum of the token's partials in rank order,
                  shared-expert input gradient last; dw gathered from the ranks' rows.
Every threshold is the number of signals its event receives from the graph of every rank.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import numpy as np

from ..ir.events import EventLayout
from ..ir.graph import GraphBuilder, TaskBlock, TaskGraph, TaskKind
from ..routing import RoutingPlan
from ..spec import TileSpec
from . import backward as bw
from .dedup import DedupLayout, make_dedup_layout, pair_pieces, signal_fed_pieces
from .tiles import Lowering, block_gemm, select_ranks, task_block, token_tiles


class DedupBackwardEvent(enum.IntEnum):
    """The per-expert backward's categories (same values, so its builders apply; DX is
    empty here), then one per received piece: GLANDED (rows arrived), GRED (every
    expert input gradient of its rows ready), GPART (its partials and router gradients
    written)."""

    GROWS = 0
    DA = 1
    DH = 2
    DX = 3
    GEXP = 4
    DHE = 5
    GOUT = 6
    SDA = 7
    SDH = 8
    SALL = 9
    SREC = 10
    GPERM = 11
    GLANDED = 12
    GRED = 13
    GPART = 14


E = DedupBackwardEvent


def dedup_backward_events(d: DedupLayout) -> EventLayout:
    base, ep = d.base, d.base.plan.par.ep
    nb, recv, local = base.blocks.count, d.pieces.per_dst, base.plan.local_experts

    def full(n: int) -> np.ndarray:
        return np.full(ep, n, np.int64)

    shared = 1 if base.shared_blocks else 0
    sizes = np.stack([nb, nb, nb, full(0), full(local), full(local), full(base.token_tiles),
                      full(base.shared_blocks), full(base.shared_blocks), full(shared), full(shared),
                      d.pieces.per_src, recv, recv, recv], axis=1)
    return EventLayout.from_sizes(DedupBackwardEvent, sizes)


def lower_dedup_backward(plan: RoutingPlan, tiles: TileSpec, ranks: tuple[int, ...] | None = None,
                         recompute: bool = False) -> TaskGraph:
    """The backward task graph of the deduplicated forward, for ``ranks`` (default: all)."""
    if not isinstance(recompute, bool):
        raise TypeError(f"recompute must be a bool, got {recompute!r}")
    ranks, sel = select_ranks(plan.par.ep, ranks)
    d = make_dedup_layout(plan, tiles)
    if len(d.hops.origin):
        raise ValueError(f"TileSpec.dispatch={tiles.dispatch.value!r} over {plan.par.nodes} nodes: the "
                         "deduplicated backward has no relays (one node, or DispatchMode.PER_RANK)")
    events = dedup_backward_events(d)
    every = _Lowering(Lowering(d.base, events, np.ones(plan.par.ep, bool), recompute), d, tiles)
    blocks = [make(every) for make in _PHASES]
    builder = GraphBuilder(plan.par.ep, ranks)
    for blk in blocks:
        builder.add(_only(blk, sel))
    ptr = np.concatenate([[0], np.cumsum(events.offset[:, -1])])
    got = np.zeros(int(ptr[-1]), np.int64)
    for blk in blocks:
        np.add.at(got, ptr[blk.sig_rank] + blk.sig_event, 1)
    for r in ranks:
        builder.set_events(r, got[ptr[r]:ptr[r + 1]])
    return builder.freeze(dtype=plan.moe.dtype, events=events, nodes=plan.par.nodes)


class _Lowering:
    """What the builders read: the per-expert backward's ``Lowering`` and the dedup layout."""

    def __init__(self, low: Lowering, d: DedupLayout, tiles: TileSpec):
        self.low, self.d, self.partial_size = low, d, tiles.partial_dtype.itemsize

    @property
    def hidden(self) -> int:
        return self.d.base.plan.moe.hidden


def _only(blk: TaskBlock, sel: np.ndarray) -> TaskBlock:
    """The tasks of ``blk`` on the selected ranks, with their signals."""
    keep = sel[blk.rank]
    if keep.all():
        return blk
    sig_keep = np.repeat(keep, blk.sig_count)
    cols = {name: getattr(blk, name)[keep] for name in ("rank", "peer", "expert", "row0", "row1", "col0",
                                                         "col1", "dst_row0", "flops", "bytes", "link_bytes",
                                                         "wait", "sig_count")}
    return TaskBlock(kind=blk.kind, sig_rank=blk.sig_rank[sig_keep], sig_event=blk.sig_event[sig_keep],
                     **cols)


# ------------------------------------------------------------------ dy out, gradients back

def _put_bytes(dl: _Lowering, i: np.ndarray, row_bytes: int) -> dict:
    p = dl.d.pieces
    nbytes = p.rows[i] * row_bytes
    return {"bytes": 2 * nbytes, "link_bytes": np.where(p.src[i] != p.dst[i], nbytes, 0)}


def _grad_permute(dl: _Lowering) -> TaskBlock:
    p, low = dl.d.pieces, dl.low
    i = np.arange(len(p.src))
    return task_block(TaskKind.GRAD_PERMUTE, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                      bytes=2 * p.rows[i] * dl.hidden * low.esize,
                      sig_event=low.events.base(p.src[i], E.GPERM) + p.local[i])


def _grad_dispatch(dl: _Lowering) -> TaskBlock:
    p, ev = dl.d.pieces, dl.low.events
    i = np.arange(len(p.src))
    return task_block(TaskKind.GRAD_DISPATCH, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                      peer=p.dst[i], dst_row0=p.recv_row0[i], sig_rank=p.dst[i],
                      wait=ev.base(p.src[i], E.GPERM) + p.local[i],
                      sig_event=ev.base(p.dst[i], E.GLANDED) + p.rlocal[i],
                      **_put_bytes(dl, i, dl.hidden * dl.low.esize))


def _expand(dl: _Lowering) -> TaskBlock:
    """Signals GROWS of every block and GEXP of every expert the piece's rows go to."""
    d, ev, p = dl.d, dl.low.events, dl.d.pieces
    b = d.base.blocks
    copies = _copies(d)
    exp = np.unique(d.feed_piece * d.base.plan.local_experts + b.expert[d.feed_block])
    ep_piece, ep_expert = exp // d.base.plan.local_experts, exp % d.base.plan.local_experts
    piece = np.concatenate([d.feed_piece, ep_piece])
    event = np.concatenate([ev.base(p.dst[d.feed_piece], E.GROWS) + b.local[d.feed_block],
                            ev.base(p.dst[ep_piece], E.GEXP) + ep_expert])
    order = np.argsort(piece, kind="stable")
    piece, event = piece[order], event[order]
    return task_block(TaskKind.EXPAND, p.dst, p.recv_row0, p.recv_row0 + p.rows,
                      flops=copies * dl.hidden, bytes=(p.rows + copies) * dl.hidden * dl.low.esize,
                      wait=ev.base(p.dst, E.GLANDED) + p.rlocal,
                      sig_count=np.bincount(piece, minlength=len(p.src)), sig_rank=p.dst[piece],
                      sig_event=event)


def _copies(d: DedupLayout) -> np.ndarray:
    per_pair = (d.pairs.slot_row >= 0).sum(axis=1)
    return np.bincount(pair_pieces(d.pieces), weights=per_pair, minlength=len(d.pieces.src)).astype(np.int64)


def _router_grad(dl: _Lowering) -> TaskBlock:
    d, ev, p = dl.d, dl.low.events, dl.d.pieces
    copies = _copies(d)
    return task_block(TaskKind.ROUTER_GRAD, p.dst, p.recv_row0, p.recv_row0 + p.rows,
                      col1=np.full(len(p.src), dl.hidden), flops=2.0 * copies * dl.hidden,
                      bytes=(copies + p.rows) * dl.hidden * dl.low.esize + 4 * p.rows * d.base.plan.moe.top_k,
                      wait=ev.base(p.dst, E.GLANDED) + p.rlocal,
                      sig_event=ev.base(p.dst, E.GPART) + p.rlocal)


def _dgrad_up(dl: _Lowering) -> TaskBlock:
    moe = dl.d.base.plan.moe
    blk = block_gemm(TaskKind.DGRAD_UP, dl.low, moe.hidden, 2 * moe.ffn, E.DH, E.DH)
    return signal_fed_pieces(dl.d, dl.low.events, blk, E.GRED)


def _partial_reduce(dl: _Lowering) -> TaskBlock:
    p, ev = dl.d.pieces, dl.low.events
    copies = _copies(dl.d)
    return task_block(TaskKind.PARTIAL_REDUCE, p.dst, p.recv_row0, p.recv_row0 + p.rows,
                      flops=copies * dl.hidden,
                      bytes=(copies * dl.low.esize + p.rows * dl.partial_size) * dl.hidden,
                      wait=ev.base(p.dst, E.GRED) + p.rlocal, sig_event=ev.base(p.dst, E.GPART) + p.rlocal)


def _back(kind: TaskKind, dl: _Lowering, row_bytes: int) -> TaskBlock:
    """Puts of every received piece back to its source, after its GPART, each
    signalling the source token tiles it carries."""
    d, ev = dl.d, dl.low.events
    p, rows, tt = d.pieces, d.base.tiles.rows, d.base.token_tiles
    key = np.unique(pair_pieces(p) * tt + d.pairs.token // rows)
    piece, tile = key // tt, key % tt
    i = np.arange(len(p.src))
    return task_block(kind, p.dst, p.recv_row0, p.recv_row0 + p.rows, peer=p.src, dst_row0=p.send_row0,
                      wait=ev.base(p.dst, E.GPART) + p.rlocal,
                      sig_count=np.bincount(piece, minlength=len(p.src)), sig_rank=p.src[piece],
                      sig_event=ev.base(p.src[piece], E.GOUT) + tile, **_put_bytes(dl, i, row_bytes))


def _grad_combine(dl: _Lowering) -> TaskBlock:
    return _back(TaskKind.GRAD_COMBINE, dl, dl.hidden * dl.partial_size)


def _router_combine(dl: _Lowering) -> TaskBlock:
    return _back(TaskKind.ROUTER_COMBINE, dl, 4 * dl.d.base.plan.moe.top_k)


def _partial_sum(dl: _Lowering) -> TaskBlock:
    low, d = dl.low, dl.d
    rank, t, r0, r1 = token_tiles(low)
    tt, rows = d.base.token_tiles, d.base.tiles.rows
    terms = np.bincount(d.pairs.origin * tt + d.pairs.token // rows,
                        minlength=d.base.plan.par.ep * tt)[rank * tt + t]
    m = r1 - r0
    shared = m if d.base.shared_blocks else 0
    return task_block(TaskKind.PARTIAL_SUM, rank, r0, r1, col1=np.full(len(rank), dl.hidden),
                      flops=(terms + shared) * dl.hidden,
                      bytes=(terms * dl.partial_size + (shared + m) * low.esize) * dl.hidden
                      + 4 * terms * d.base.plan.moe.top_k,
                      wait=low.events.base(rank, E.GOUT) + t)


def _per_expert(make: Callable[[Lowering], TaskBlock]) -> Callable[[_Lowering], TaskBlock]:
    """A builder of the per-expert backward applied to the dedup lowering."""
    return lambda dl: make(dl.low)


_PHASES = (_grad_permute, _grad_dispatch, _expand, _router_grad, _per_expert(bw._recompute),
           _per_expert(bw._dgrad_down), _per_expert(bw._swiglu_bwd), _dgrad_up, _partial_reduce,
           _grad_combine, _router_combine, _per_expert(bw._wgrad_down), _per_expert(bw._wgrad_up),
           *(_per_expert(make) for make in (bw._shared_dgrad_down, bw._shared_swiglu_bwd, bw._shared_dgrad_up,
                                            bw._shared_wgrad_down, bw._shared_wgrad_up)),
           _partial_sum)

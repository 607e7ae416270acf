"""Backward of the rank-deduplicated forward (``DispatchMode.PER_RANK``, and
``PER_NODE`` over nodes): the output gradient travels as the forward's input did, once
per (token, destination rank), through the same relays between nodes, and the input
gradient comes back as one partial row per (token, rank), summed per node on the relay,
over the forward's pairs, hops and pieces.

With y = sum_j w_j o_j + shared(x), per rank, in data-flow order:
  GRAD_PERMUTE    one per piece: gather dy rows of (token, destination rank) pairs;
  GRAD_DISPATCH   one per piece: put them into the destination's ``gdrecv`` rows;
  EXPAND          one per received piece: each row, its routing weight w_j riding, into
                  the rows of every local expert the token chose, signalling those blocks'
                  GROWS and those experts' GEXP;
  ROUTER_GRAD     one per received piece, after GRED: dw[t, j] for the rank's slots, the
                  router gradients <d, act(h)> the experts' SWIGLU_BWD computed;
  DGRAD_DOWN / SWIGLU_BWD / DGRAD_UP / WGRAD_* / SWIGLU_RECOMPUTE   as in the
                  per-expert backward; DGRAD_UP signals GRED of every piece its block feeds;
  PARTIAL_REDUCE  one per received piece: fp32 sum of the rank's expert input gradients
                  of each pair, slot order, cast to ``tiles.partial_dtype``;
  GRAD_COMBINE    one per piece: put the partial rows back to the source;
  ROUTER_COMBINE  one per piece: put the routing-weight gradients back to the source;
  SHARED_*        the shared experts' backward tiles on the rank's own tokens;
  PARTIAL_SUM     one per token tile: dx = fp32 sum of the token's partials in rank order,
                  shared-expert input gradient last; dw gathered from the ranks' rows.
Between nodes, as in the forward (the same builders): GRAD_PERMUTE also gathers the hop
rows, HOP_DISPATCH and RELAY_PACK carry dy to the node's ranks, GRAD_COMBINE and
ROUTER_COMBINE of a forwarded piece go back to the relay, NODE_REDUCE sums the node's
partials (and gathers its router gradients), HOP_COMBINE and HOP_ROUTER_COMBINE cross back.
Every threshold is the number of signals its event receives from the graph of every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ..ir.events import EventLayout, extended
from ..ir.graph import TaskBlock, TaskGraph, TaskKind
from ..routing import RoutingPlan
from ..spec import TileSpec
from . import backward as bw
from . import dedup as dd
from .base import Kept, as_kept
from .dedup import DedupLowering, signal_fed_pieces
from .dedup_layout import DedupLayout, make_dedup_layout
from .tiles import Lowering, block_gemm, lower_graph, select_ranks, task_block

DedupBackwardEvent = extended("DedupBackwardEvent", __name__, bw.BackwardEvent,
                              ("GLANDED", "GRED", "GPART", "HOP", "HRED", "HDONE"),
                              {"PERM": "GPERM", "LANDED": "GLANDED", "PART": "GPART", "OUT": "GOUT"})
"""The per-expert backward's categories (DX empty here); one per received piece: GLANDED
(rows arrived), GRED (every expert input gradient of its rows ready), GPART (its partials
and router gradients written); as in the forward, HOP one per delivery piece sent, HRED
and HDONE one per hop piece received.  PERM, LANDED, PART and OUT name GPERM, GLANDED,
GPART and GOUT for the forward's builders."""

E = DedupBackwardEvent


def dedup_backward_events(d: DedupLayout) -> EventLayout:
    base = d.base
    nb, recv, local, sb = base.blocks.count, d.pieces.per_dst, base.plan.local_experts, base.shared_blocks
    shared, hops = 1 if sb else 0, d.hop_pieces.per_dst
    return EventLayout.from_columns(DedupBackwardEvent, base.plan.par.ep, [
        nb, nb, nb, 0, local, local, base.token_tiles, sb, sb, shared, shared,
        d.pieces.per_src + d.hop_pieces.per_src, recv, recv, recv, d.pieces.per_src, hops, hops])


def lower_dedup_backward(plan: RoutingPlan, tiles: TileSpec, ranks: tuple[int, ...] | None = None,
                         recompute: Kept | bool = False, layout: DedupLayout | None = None) -> TaskGraph:
    """The backward task graph of the deduplicated forward, for ``ranks`` (default: all);
    ``recompute``: what it finds kept (``backward.lower_backward``'s); ``layout``:
    ``make_dedup_layout(plan, tiles)`` when the caller has it already."""
    kept = as_kept(recompute)
    _, sel = select_ranks(plan.par.ep, ranks)
    d = layout or make_dedup_layout(plan, tiles)
    events = dedup_backward_events(d)
    every = _Lowering(Lowering(d.base, events, np.ones(plan.par.ep, bool), kept), d, tiles)
    return lower_graph(_PHASES, every, every, sel, events, plan.moe.dtype, plan.par.nodes)


class _Lowering:
    """What the builders read: the per-expert backward's ``Lowering`` and the dedup layout."""

    def __init__(self, low: Lowering, d: DedupLayout, tiles: TileSpec):
        self.low, self.d, self.partial_size = low, d, tiles.partial_dtype.itemsize
        self.fwd = DedupLowering(low, d, self.partial_size, _GRAD_KINDS)

    @property
    def hidden(self) -> int:
        return self.d.base.plan.moe.hidden


# ------------------------------------------------------------------ dy out, gradients back

_GRAD_KINDS = {TaskKind.PERMUTE: TaskKind.GRAD_PERMUTE, TaskKind.DISPATCH: TaskKind.GRAD_DISPATCH,
               TaskKind.COMBINE: TaskKind.GRAD_COMBINE}


def _forward(make: Callable[..., TaskBlock], **kw: object) -> Callable[[_Lowering], TaskBlock]:
    """A builder of the deduplicated forward, on this region's events and kinds."""
    return lambda dl: make(dl.fwd, **kw)


def _router_back(make: Callable[..., TaskBlock], kind: TaskKind) -> Callable[[_Lowering], TaskBlock]:
    """``make`` (a combine builder of the forward) moving k fp32 router gradients per row as ``kind``."""
    def build(dl: _Lowering) -> TaskBlock:
        kinds = {**_GRAD_KINDS, TaskKind.COMBINE: kind, TaskKind.HOP_COMBINE: kind}
        return make(replace(dl.fwd, kinds=kinds), row_bytes=4 * dl.d.base.plan.moe.top_k)
    return build


def _expand(dl: _Lowering) -> TaskBlock:
    """Signals GROWS of every block and GEXP of every expert the piece's rows go to."""
    d, ev, p = dl.d, dl.low.events, dl.d.pieces
    b = d.base.blocks
    copies = d.piece_copies
    exp = np.unique(d.feed_piece * d.base.plan.local_experts + b.expert[d.feed_block])
    ep_piece, ep_expert = exp // d.base.plan.local_experts, exp % d.base.plan.local_experts
    piece = np.concatenate([d.feed_piece, ep_piece])
    event = np.concatenate([ev.base(p.dst[d.feed_piece], E.GROWS) + b.local[d.feed_block],
                            ev.base(p.dst[ep_piece], E.GEXP) + ep_expert])
    order = np.argsort(piece, kind="stable")
    piece, event = piece[order], event[order]
    return task_block(TaskKind.EXPAND, p.dst, p.recv_row0, p.recv_row0 + p.rows,
                      flops=copies * dl.hidden, bytes=(p.rows + copies) * dl.fwd.row_bytes,
                      wait=ev.base(p.dst, E.GLANDED) + p.rlocal,
                      sig_count=np.bincount(piece, minlength=len(p.src)), sig_rank=p.dst[piece],
                      sig_event=event)


def _router_grad(dl: _Lowering) -> TaskBlock:
    d, ev, p = dl.d, dl.low.events, dl.d.pieces
    copies = d.piece_copies
    k = d.base.plan.moe.top_k
    return task_block(TaskKind.ROUTER_GRAD, p.dst, p.recv_row0, p.recv_row0 + p.rows,
                      col1=np.full(len(p.src), k), bytes=4 * (copies + p.rows * k),
                      wait=ev.base(p.dst, E.GRED) + p.rlocal,
                      sig_event=ev.base(p.dst, E.GPART) + p.rlocal)


def _dgrad_up(dl: _Lowering) -> TaskBlock:
    moe = dl.d.base.plan.moe
    blk = block_gemm(TaskKind.DGRAD_UP, dl.low, moe.hidden, 2 * moe.ffn, E.DH, E.DH)
    return signal_fed_pieces(dl.d, dl.low.events, blk, E.GRED)


def _partial_reduce(dl: _Lowering) -> TaskBlock:
    p, ev = dl.d.pieces, dl.low.events
    copies = dl.d.piece_copies
    return task_block(TaskKind.PARTIAL_REDUCE, p.dst, p.recv_row0, p.recv_row0 + p.rows,
                      flops=copies * dl.hidden,
                      bytes=(copies * dl.low.esize + p.rows * dl.partial_size) * dl.hidden,
                      wait=ev.base(p.dst, E.GRED) + p.rlocal, sig_event=ev.base(p.dst, E.GPART) + p.rlocal)


_E = dd.on_experts  # a builder of the per-expert backward on this lowering
_PHASES = (_forward(dd._permute), _forward(dd._hop_dispatch), _forward(dd._relay_pack),
           _forward(dd._dispatch), _expand, _E(bw._recompute), _E(bw._dgrad_down), _E(bw._swiglu_bwd),
           _dgrad_up, _router_grad, _partial_reduce, _forward(dd._combine),
           _router_back(dd._combine, TaskKind.ROUTER_COMBINE),
           _forward(dd._node_reduce), _forward(dd._hop_combine),
           _router_back(dd._hop_combine, TaskKind.HOP_ROUTER_COMBINE), _E(bw._wgrad_down), _E(bw._wgrad_up),
           *(_E(make) for make in (bw._shared_dgrad_down, bw._shared_swiglu_bwd, bw._shared_dgrad_up,
                                   bw._shared_wgrad_down, bw._shared_wgrad_up)),
           _forward(dd._partial_sum))

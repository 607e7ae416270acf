"""Kernels, buffers and the ``Region`` of the deduplicated backward
(``regions/dedup_backward.py``).  The expert and shared-expert kernels are the
per-expert backward's, on same-named fields; GRAD_PERMUTE, EXPAND, ROUTER_GRAD,
PARTIAL_REDUCE and PARTIAL_SUM are this region's.

Numerics as the per-expert backward's: EXPAND hands each expert row its token's dy row
unweighted, its routing weight riding (``backward_kernels.rider``), and the expert's
SWIGLU_BWD sends the row's router gradient <d, act(h)> back riding with its input
gradient; input gradients are summed per rank in fp32 slot order, cast to the wire
dtype, then over ranks in rank order, shared expert last (``refs.rank_partials_sum``
with unit weights).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..deprecation import deprecated
from ..ir.graph import TaskKind, Tile
from ..routing import Routing, RoutingPlan
from ..spec import PLAIN_GLU, Activation, GluForm, TileSpec
from ..weights import ExpertWeights, Rows
from .backward_kernels import (
    BACKWARD_KERNELS,
    ROW_TAIL,
    GradientBuffers,
    SavedActivations,
    carried_rows,
    gradient_fields,
    gradient_shapes,
    rider,
    row_width,
)
from .base import Kept, PutSpec, Region, RegionKind, ShapeMap, as_kept
from .dedup_backward import lower_dedup_backward
from .dedup_kernels import DedupContext, gather_sum, layout_shapes, send_rows_of_slots
from .dedup_layout import DedupLayout, make_dedup_layout


def __getattr__(name: str) -> object:
    """``DedupSaved``: the deduplicated forward keeps what the per-expert one keeps, so
    its class is ``SavedActivations`` now (the old name works, with a warning, until the
    next release)."""
    if name == "DedupSaved":
        deprecated("regions.dedup_backward_kernels.DedupSaved",
                   "backward_kernels.SavedActivations (the same fields)")
        return SavedActivations
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(kw_only=True)
class DedupBackwardBuffers(GradientBuffers):
    """One rank's deduplicated backward buffers (``GradientBuffers``; gsend [Sd, D], grecv
    [R, W] its experts' rows, expanded here; D = ``dy_width``: H, and the input rows beside
    where they travel).  Symmetric: ``gdrecv`` [Rd, D] (dy rows delivered here), ``gpcomb``
    [Sd, H] partial dtype and ``dwcomb`` [Sd, k] float32 (what comes back per send row),
    ``ghrecv`` [Hr, D] (dy rows this rank relays).  gpart [Rd, H] and gnred [Hr, H] partial
    dtype; dwpart [Rd, k], dwnred [Hr, k] float32."""

    SYMMETRIC: ClassVar[tuple[str, ...]] = ("gdrecv", "gpcomb", "dwcomb", "ghrecv")

    saved: SavedActivations
    gdrecv: torch.Tensor
    gpart: torch.Tensor
    dwpart: torch.Tensor
    gpcomb: torch.Tensor
    dwcomb: torch.Tensor
    ghrecv: torch.Tensor
    gnred: torch.Tensor
    dwnred: torch.Tensor

    @staticmethod
    def allocate(saved: SavedActivations, dy: torch.Tensor, d: DedupLayout, tiles: TileSpec, rank: int,
                 views: Mapping[str, torch.Tensor | Rows] | None = None) -> DedupBackwardBuffers:
        """Buffers of ``rank`` holding dy [T, H]; ``views`` may supply any field (checked):
        the symmetric ones in a symmetric heap, ``dx``, ``dw`` (slices of full-size
        outputs) and ``dw13``, ``dw2`` (and ``db13``, ``db2``: the rows of zero-filled ones,
        ``SlotGradients.views``)."""
        moe = d.base.plan.moe
        t, k, h, pd, f32 = dy.shape[0], moe.top_k, moe.hidden, tiles.partial_dtype, torch.float32
        sd, rd, hr = int(d.send_rows[rank]), int(d.pairs.per_dst[rank]), int(d.hops.per_dst[rank])
        hd = dy_width(h, saved.travels)
        common = gradient_shapes(moe, d.base.plan.local_experts, t, saved.h.shape[0], saved.travels)
        shapes = {n: v for n, v in common.items() if n != "gcomb"}  # gsend: below, a row per (token, rank)
        for name, rows, width, dtype in (("gsend", sd, hd, moe.dtype), ("gdrecv", rd, hd, moe.dtype),
                                         ("gpart", rd, h, pd), ("dwpart", rd, k, f32), ("gpcomb", sd, h, pd),
                                         ("dwcomb", sd, k, f32), ("ghrecv", hr, hd, moe.dtype),
                                         ("gnred", hr, h, pd), ("dwnred", hr, k, f32)):
            shapes[name] = ((rows, width), dtype, False)
        full, bufs = gradient_fields(shapes, saved, dy, views)
        return DedupBackwardBuffers(saved=full, dy=dy, **bufs)


@dataclass
class DedupBackwardContext:
    """Read-only data of one rank: its experts' and the shared weights (as the
    per-expert ``BackwardContext``); ``fwd``: the forward's context (send-row tokens,
    expand CSR, slot rows and weights, partial rows); expand_weight: the routing weight
    of each expand entry; slot_send_row [T, k]: send row of the pair carrying each of
    a token's slots."""

    w13: Rows
    w2: Rows
    shared_w13: torch.Tensor | None
    shared_w2: torch.Tensor | None
    activation: Activation
    fwd: DedupContext
    expand_weight: torch.Tensor
    slot_send_row: torch.Tensor
    glu: GluForm = PLAIN_GLU
    b2: Rows | None = None  # [L][H] the experts' down biases, or None

    @staticmethod
    def build(weights: ExpertWeights, d: DedupLayout, routing: Routing, rank: int) -> DedupBackwardContext:
        fwd = DedupContext.build(weights, d, routing, rank)
        row = fwd.expand_src
        slot = fwd.slot_row[row] == fwd.expand_dst[:, None]
        weight = fwd.slot_weight[row][slot]
        return DedupBackwardContext(w13=fwd.w13, w2=fwd.w2, shared_w13=weights.shared_w13,
                                    shared_w2=weights.shared_w2, activation=weights.spec.activation, fwd=fwd,
                                    expand_weight=weight, slot_send_row=torch.from_numpy(
                                        send_rows_of_slots(d, routing, rank)), glu=weights.spec.glu,
                                    b2=fwd.b2)


Buffers, Context = DedupBackwardBuffers, DedupBackwardContext


def dy_width(hidden: int, carried: bool) -> int:
    """Elements of a deduplicated dy row: a travelling row (``row_width``) without the
    rider, as receivers weigh rows (H, rounded up to even, and the token's input row
    beside it where ``carried``)."""
    return row_width(hidden, carried) - ROW_TAIL


def _grad_permute(t: Tile, me: Buffers, peer: Buffers, ctx: Context) -> None:
    tokens, h = ctx.fwd.token_of_row[t.row0:t.row1], me.dy.shape[1]
    me.gsend[t.row0:t.row1, :h] = me.dy.index_select(0, tokens)
    if me.saved.travels:
        carried_rows(me.gsend[t.row0:t.row1], h).copy_(me.saved.x.index_select(0, tokens))


def _expand(t: Tile, me: Buffers, peer: Buffers, ctx: Context) -> None:
    """Each expert row of the delivered rows: its token's dy row, its routing weight riding
    (and its input row beside it where rows travel)."""
    lo, hi = ctx.fwd.expand_ptr[t.row0], ctx.fwd.expand_ptr[t.row1]
    dst, src, h = ctx.fwd.expand_dst[lo:hi], ctx.fwd.expand_src[lo:hi], me.dy.shape[1]
    me.grecv[dst, :h] = me.gdrecv[:, :h].index_select(0, src)
    if me.saved.travels:
        carried_rows(me.grecv, h)[dst] = carried_rows(me.gdrecv, h).index_select(0, src)
    rider(me.grecv)[dst] = ctx.expand_weight[lo:hi]


def _router_grad(t: Tile, me: Buffers, peer: Buffers, ctx: Context) -> None:
    """dw[row, j]: the router gradient of the slot's expert row, for the slots on this
    rank (0 elsewhere)."""
    rows = ctx.fwd.slot_row[t.row0:t.row1]
    me.dwpart[t.row0:t.row1] = torch.where(rows >= 0, rider(me.dxe)[rows.clamp(min=0)], 0.0)


def _partial_reduce(t: Tile, me: Buffers, peer: Buffers, ctx: Context) -> None:
    h = me.gpart.shape[1]
    me.gpart[t.row0:t.row1] = gather_sum(me.dxe[:, :h], ctx.fwd.slot_row[t.row0:t.row1]).to(me.gpart.dtype)


def _relay_pack(t: Tile, me: Buffers, peer: Buffers, ctx: Context) -> None:
    torch.index_select(me.ghrecv, 0, ctx.fwd.relay_src[t.row0:t.row1], out=me.gsend[t.row0:t.row1])


def _node_reduce(t: Tile, me: Buffers, peer: Buffers, ctx: Context) -> None:
    """Per relayed hop: the node's input-gradient partials summed in fp32, rank order,
    and its router gradients (each slot's from the one rank holding it, zeros elsewhere)."""
    rows = ctx.fwd.hop_rows[t.row0:t.row1]
    me.gnred[t.row0:t.row1] = gather_sum(me.gpcomb, rows).to(me.gnred.dtype)
    me.dwnred[t.row0:t.row1] = gather_sum(me.dwcomb, rows)


def _partial_sum(t: Tile, me: Buffers, peer: Buffers, ctx: Context) -> None:
    """dx: the token's partials in rank order, then the shared expert's; dw: each slot's
    value from the rank holding its expert."""
    acc = gather_sum(me.gpcomb, ctx.fwd.partial_row[t.row0:t.row1])
    if me.gpcomb.shape[0]:
        slots = ctx.slot_send_row[t.row0:t.row1]
        me.dw[t.row0:t.row1] = me.dwcomb[slots, torch.arange(slots.shape[1], device=slots.device)]
    if ctx.shared_w13 is not None:
        acc = acc + me.sdx[t.row0:t.row1].float()
    me.dx[t.row0:t.row1] = acc.to(me.dx.dtype)


DEDUP_BACKWARD_KERNELS = {
    **{k: v for k, v in BACKWARD_KERNELS.items()
       if k not in (TaskKind.GRAD_PERMUTE, TaskKind.GRAD_UNPERMUTE, TaskKind.ROUTER_GRAD)},
    TaskKind.GRAD_PERMUTE: _grad_permute, TaskKind.EXPAND: _expand, TaskKind.ROUTER_GRAD: _router_grad,
    TaskKind.PARTIAL_REDUCE: _partial_reduce, TaskKind.PARTIAL_SUM: _partial_sum,
    TaskKind.RELAY_PACK: _relay_pack, TaskKind.NODE_REDUCE: _node_reduce,
}


def gradient_layout_shapes(d: DedupLayout, tiles: TileSpec, rank: int, carried: bool = False) -> ShapeMap:
    """gdrecv, ghrecv and gpcomb: the forward's ``layout_shapes`` of ``rank`` (the dy rows
    ``dy_width`` wide); dwcomb [Sd, k] fp32."""
    fwd = layout_shapes(d, tiles, rank)
    moe = d.base.plan.moe

    def dy_rows(field: str) -> tuple[tuple[int, ...], torch.dtype]:
        return (fwd[field][0][0], dy_width(moe.hidden, carried)), fwd[field][1]

    return {"gdrecv": dy_rows("drecv"), "gpcomb": fwd["pcomb"], "ghrecv": dy_rows("hrecv"),
            "dwcomb": ((int(d.send_rows[rank]), moe.top_k), torch.float32)}


def dedup_backward_symmetric_shapes(plan: RoutingPlan, tiles: TileSpec, rank: int,
                                    carried: bool = False) -> ShapeMap:
    """``gradient_layout_shapes`` of ``plan``'s layout under ``tiles``."""
    return gradient_layout_shapes(make_dedup_layout(plan, tiles), tiles, rank, carried)


_KINDS = {Kept.ALL: RegionKind.BACKWARD_DEDUP, Kept.ROWS: RegionKind.BACKWARD_DEDUP_RECOMPUTE,
          Kept.INPUT: RegionKind.BACKWARD_DEDUP_REGATHER}


def _region(kept: Kept) -> Region:
    return Region(
        kind=_KINDS[kept], lower=functools.partial(lower_dedup_backward, recompute=kept),
        kernels=DEDUP_BACKWARD_KERNELS,
        puts={TaskKind.GRAD_DISPATCH: PutSpec(src="gsend", dst="gdrecv"),
              TaskKind.GRAD_COMBINE: PutSpec(src="gpart", dst="gpcomb"),
              TaskKind.ROUTER_COMBINE: PutSpec(src="dwpart", dst="dwcomb"),
              TaskKind.HOP_DISPATCH: PutSpec(src="gsend", dst="ghrecv"),
              TaskKind.HOP_COMBINE: PutSpec(src="gnred", dst="gpcomb"),
              TaskKind.HOP_ROUTER_COMBINE: PutSpec(src="dwnred", dst="dwcomb")},
        buffers=DedupBackwardBuffers,
        symmetric_shapes=functools.partial(dedup_backward_symmetric_shapes, carried=kept.travels))


BACKWARD_DEDUPS = {k: _region(k) for k in Kept}
BACKWARD_DEDUP, BACKWARD_DEDUP_RECOMPUTE, BACKWARD_DEDUP_REGATHER = BACKWARD_DEDUPS.values()


def dedup_backward_region(d: DedupLayout, recompute: Kept | bool = False) -> Region:
    """The deduplicated backward region of what is kept (``base.as_kept``) for the plan
    and tiles of layout ``d``, whose lowering and symmetric shapes read ``d`` instead of
    rebuilding it."""
    kept = as_kept(recompute)
    return replace(BACKWARD_DEDUPS[kept],
                   lower=functools.partial(lower_dedup_backward, recompute=kept, layout=d),
                   symmetric_shapes=lambda _plan, tiles, rank: gradient_layout_shapes(d, tiles, rank,
                                                                                      kept.travels))

"""Kernels, buffers and the ``Region`` of the rank-deduplicated forward
(``DispatchMode.PER_RANK``).  PERMUTE, the expert GEMMs, SwiGLU and the shared expert
are the per-expert forward's kernels on same-named fields; EXPAND, PARTIAL_REDUCE and
PARTIAL_SUM are new, and under ``PER_NODE`` RELAY_PACK and NODE_REDUCE."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch

from ..ir.graph import TaskKind, Tile
from ..refs import add_present
from ..routing import Routing, RoutingPlan
from ..spec import TileSpec
from ..weights import ExpertWeights, Rows
from .base import PutSpec, Region, RegionKind, ShapeMap
from .dedup import lower_dedup
from .dedup_layout import DedupLayout, make_dedup_layout
from .kernels import KERNELS, ExpertBuffers, expert_fields


@dataclass(kw_only=True)
class DedupBuffers(ExpertBuffers):
    """One rank's deduplicated forward buffers (``ExpertBuffers``; send [Sd, H]: delivered
    rows, then hops).  Symmetric: ``drecv`` [Rd, H] (one row per (token, this rank)
    delivered here), ``pcomb`` [Sd, H] partial dtype (one partial per send row) and
    ``hrecv`` [Hr, H] (one row per hop relayed by this rank).  part [Rd, H] and nred
    [Hr, H] partial dtype."""

    SYMMETRIC: ClassVar[tuple[str, ...]] = ("drecv", "pcomb", "hrecv")

    drecv: torch.Tensor
    part: torch.Tensor
    pcomb: torch.Tensor
    hrecv: torch.Tensor
    nred: torch.Tensor

    @staticmethod
    def allocate(x: torch.Tensor, d: DedupLayout, tiles: TileSpec, rank: int,
                 symmetric: Mapping[str, torch.Tensor] | None = None) -> DedupBuffers:
        """Buffers of ``rank`` holding its tokens ``x`` [T, H]; ``symmetric`` may supply
        the symmetric fields (views of a symmetric heap)."""
        plan = d.base.plan
        moe, sym = plan.moe, dict(symmetric or {})
        sd, rd, hr = int(d.send_rows[rank]), int(d.pairs.per_dst[rank]), int(d.hops.per_dst[rank])

        def new(name: str, rows: int, dtype: torch.dtype = moe.dtype) -> torch.Tensor:
            made = sym.get(name)
            return torch.empty(rows, moe.hidden, dtype=dtype, device=x.device) if made is None else made

        pd = tiles.partial_dtype
        return DedupBuffers(**expert_fields(x, moe, sd, plan.recv_rows(rank)), drecv=new("drecv", rd),
                            part=new("part", rd, pd), pcomb=new("pcomb", sd, pd), hrecv=new("hrecv", hr),
                            nred=new("nred", hr, pd))


@dataclass
class DedupContext:
    """Read-only data of one rank.  w13 [L][2F, H], w2 [L][H, F]: its experts (read in place).
    token_of_row [Sd]: token of each send row it gathers from x (0 for forwarded
    rows).  relay_src [Sd]: ``hrecv`` row of each forwarded send row (-1 elsewhere).
    expand_ptr [Rd + 1], expand_src, expand_dst: drecv row -> per-expert receive rows
    (CSR by drecv row).  slot_row [Rd, k]: receive row of each top-k slot of each
    drecv row (-1: not on this rank), slot_weight [Rd, k] float32 (0 there).
    hop_rows [Hr, k]: send/pcomb rows of each relayed hop's forwarded rows, ascending
    destination rank (-1 past the last).  partial_row [T, k]: send/pcomb row of each
    of a token's partials, ascending (rank, or first rank of another node) (-1 past
    the last)."""

    weights: ExpertWeights
    w13: Rows
    w2: Rows
    token_of_row: torch.Tensor
    relay_src: torch.Tensor
    expand_ptr: list[int]
    expand_src: torch.Tensor
    expand_dst: torch.Tensor
    slot_row: torch.Tensor
    slot_weight: torch.Tensor
    hop_rows: torch.Tensor
    partial_row: torch.Tensor
    b13: Rows | None = None  # [L][2F] / [L][H]: its experts' biases, or None
    b2: Rows | None = None

    @staticmethod
    def build(weights: ExpertWeights, d: DedupLayout, routing: Routing, rank: int) -> DedupContext:
        plan, pairs = d.base.plan, d.pairs
        local, tpr = plan.local_experts, plan.par.tokens_per_rank
        mine = weights.local(slice(rank * local, (rank + 1) * local))
        got = np.flatnonzero(pairs.dst == rank)
        got = got[np.argsort(pairs.recv_row[got], kind="stable")]
        slot_row = pairs.slot_row[got]
        w = routing.weights.numpy()[pairs.origin[got] * tpr + pairs.token[got]]
        row, j = np.nonzero(slot_row >= 0)  # by drecv row, then slot
        token_of_row, relay_src = _send_sources(d, rank)
        return DedupContext(
            weights=weights, w13=mine.w13, w2=mine.w2,
            token_of_row=torch.from_numpy(token_of_row), relay_src=torch.from_numpy(relay_src),
            expand_ptr=np.searchsorted(row, np.arange(len(got) + 1)).tolist(),
            expand_src=torch.from_numpy(row.copy()), expand_dst=torch.from_numpy(slot_row[row, j].copy()),
            slot_row=torch.from_numpy(slot_row.copy()),
            slot_weight=torch.from_numpy(np.where(slot_row >= 0, w, 0.0).astype(np.float32)),
            hop_rows=torch.from_numpy(_hop_rows(d, rank)),
            partial_row=torch.from_numpy(_partial_rows(d, rank)), b13=mine.b13, b2=mine.b2)


def _send_sources(d: DedupLayout, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """([Sd] token of each send row gathered from x, [Sd] hrecv row of each forwarded one)."""
    pairs, hops = d.pairs, d.hops
    n = int(d.send_rows[rank])
    token, relay_src = np.zeros(n, np.int64), np.full(n, -1, np.int64)
    own = np.flatnonzero((pairs.src == rank) & ~pairs.fwd)
    token[pairs.send_row[own]] = pairs.token[own]
    hop = np.flatnonzero(hops.origin == rank)
    token[hops.send_row[hop]] = hops.token[hop]
    fwd = np.flatnonzero((pairs.src == rank) & pairs.fwd)
    relay_src[pairs.send_row[fwd]] = hops.recv_row[pairs.hop[fwd]]
    return token, relay_src


def _by_key(n: int, width: int, item: np.ndarray, key: np.ndarray, value: np.ndarray) -> np.ndarray:
    """[n, width] values of each item, ascending key, -1 past the last."""
    out = np.full((n, width), -1, np.int64)
    order = np.lexsort((key, item))
    it = item[order]
    out[it, np.arange(len(it)) - np.searchsorted(it, it, side="left")] = value[order]
    return out


def _hop_rows(d: DedupLayout, rank: int) -> np.ndarray:
    pairs, hops = d.pairs, d.hops
    fwd = np.flatnonzero((pairs.src == rank) & pairs.fwd)
    return _by_key(int(hops.per_dst[rank]), d.base.plan.moe.top_k, hops.recv_row[pairs.hop[fwd]],
                   pairs.dst[fwd], pairs.send_row[fwd])


def _partial_rows(d: DedupLayout, rank: int) -> np.ndarray:
    pairs, hops, par = d.pairs, d.hops, d.base.plan.par
    own = np.flatnonzero((pairs.origin == rank) & ~pairs.fwd)
    hop = np.flatnonzero(hops.origin == rank)
    first = hops.relay[hop] // par.ranks_per_node * par.ranks_per_node
    return _by_key(par.tokens_per_rank, d.base.plan.moe.top_k,
                   np.concatenate([pairs.token[own], hops.token[hop]]),
                   np.concatenate([pairs.dst[own], first]),
                   np.concatenate([pairs.send_row[own], hops.send_row[hop]]))


def _expand(t: Tile, me: DedupBuffers, peer: DedupBuffers, ctx: DedupContext) -> None:
    lo, hi = ctx.expand_ptr[t.row0], ctx.expand_ptr[t.row1]
    me.recv.index_copy_(0, ctx.expand_dst[lo:hi], me.drecv.index_select(0, ctx.expand_src[lo:hi]))


def gather_sum(src: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """[m, C] fp32: for each of m rows, the sum over slots j, in slot order, of
    src[rows[:, j]] (times weight[:, j]) in fp32; a slot of -1 adds nothing (+0.0)."""
    acc = torch.zeros(rows.shape[0], src.shape[1], dtype=torch.float32, device=src.device)
    if src.shape[0] == 0:  # nothing was received: every slot is -1
        return acc
    for j in range(rows.shape[1]):
        term = src[rows[:, j].clamp(min=0)].float()
        acc = add_present(acc, term if weight is None else weight[:, j:j + 1] * term, rows[:, j] >= 0)
    return acc


def _partial_reduce(t: Tile, me: DedupBuffers, peer: DedupBuffers, ctx: DedupContext) -> None:
    acc = gather_sum(me.y, ctx.slot_row[t.row0:t.row1], ctx.slot_weight[t.row0:t.row1])
    me.part[t.row0:t.row1] = acc.to(me.part.dtype)


def send_rows_of_slots(d: DedupLayout, routing: Routing, rank: int) -> np.ndarray:
    """[T, k] send row of the row carrying each top-k slot of ``rank``'s tokens: the
    pair to the slot's rank within the token's node, else the hop to its node."""
    plan, pairs, hops = d.base.plan, d.pairs, d.hops
    tpr, local, ep, rpn = plan.par.tokens_per_rank, plan.local_experts, plan.par.ep, plan.par.ranks_per_node
    table = np.full(ep * tpr, -1, np.int64)
    hop = np.flatnonzero(hops.origin == rank)  # by destination node: its ranks all map to the hop
    for r in range(rpn):
        table[(hops.relay[hop] // rpn * rpn + r) * tpr + hops.token[hop]] = hops.send_row[hop]
    mine = np.flatnonzero((pairs.origin == rank) & ~pairs.fwd)
    table[pairs.dst[mine] * tpr + pairs.token[mine]] = pairs.send_row[mine]
    ids = routing.ids.numpy()[rank * tpr:(rank + 1) * tpr]
    return table[(ids // local) * tpr + np.arange(tpr)[:, None]]


def _relay_pack(t: Tile, me: DedupBuffers, peer: DedupBuffers, ctx: DedupContext) -> None:
    torch.index_select(me.hrecv, 0, ctx.relay_src[t.row0:t.row1], out=me.send[t.row0:t.row1])


def _node_reduce(t: Tile, me: DedupBuffers, peer: DedupBuffers, ctx: DedupContext) -> None:
    me.nred[t.row0:t.row1] = gather_sum(me.pcomb, ctx.hop_rows[t.row0:t.row1]).to(me.nred.dtype)


def _partial_sum(t: Tile, me: DedupBuffers, peer: DedupBuffers, ctx: DedupContext) -> None:
    acc = gather_sum(me.pcomb, ctx.partial_row[t.row0:t.row1])
    if ctx.weights.has_shared:
        acc = acc + me.so[t.row0:t.row1].float()
    me.out[t.row0:t.row1] = acc.to(me.out.dtype)


DEDUP_KERNELS = {
    **{k: KERNELS[k] for k in (TaskKind.PERMUTE, TaskKind.GEMM_UP, TaskKind.SWIGLU, TaskKind.GEMM_DOWN,
                               TaskKind.SHARED_UP, TaskKind.SHARED_SWIGLU, TaskKind.SHARED_DOWN)},
    TaskKind.EXPAND: _expand, TaskKind.PARTIAL_REDUCE: _partial_reduce, TaskKind.PARTIAL_SUM: _partial_sum,
    TaskKind.RELAY_PACK: _relay_pack, TaskKind.NODE_REDUCE: _node_reduce,
}


def layout_shapes(d: DedupLayout, tiles: TileSpec, rank: int) -> ShapeMap:
    """drecv [Rd, H] and hrecv [Hr, H] in the layer's dtype, pcomb [Sd, H] in the partial
    dtype, of ``rank`` under layout ``d``."""
    moe = d.base.plan.moe
    return {"drecv": ((int(d.pairs.per_dst[rank]), moe.hidden), moe.dtype),
            "pcomb": ((int(d.send_rows[rank]), moe.hidden), tiles.partial_dtype),
            "hrecv": ((int(d.hops.per_dst[rank]), moe.hidden), moe.dtype)}


def dedup_symmetric_shapes(plan: RoutingPlan, tiles: TileSpec, rank: int) -> ShapeMap:
    """``layout_shapes`` of ``plan``'s layout under ``tiles``."""
    return layout_shapes(make_dedup_layout(plan, tiles), tiles, rank)


FORWARD_DEDUP = Region(
    kind=RegionKind.FORWARD_DEDUP, lower=lower_dedup, kernels=DEDUP_KERNELS,
    puts={TaskKind.DISPATCH: PutSpec(src="send", dst="drecv"),
          TaskKind.COMBINE: PutSpec(src="part", dst="pcomb"),
          TaskKind.HOP_DISPATCH: PutSpec(src="send", dst="hrecv"),
          TaskKind.HOP_COMBINE: PutSpec(src="nred", dst="pcomb")},
    buffers=DedupBuffers, symmetric_shapes=dedup_symmetric_shapes)


def dedup_region(d: DedupLayout) -> Region:
    """``FORWARD_DEDUP`` for the plan and tiles of layout ``d``, whose lowering and symmetric
    shapes read ``d`` instead of rebuilding it."""
    return replace(FORWARD_DEDUP, lower=functools.partial(lower_dedup, layout=d),
                   symmetric_shapes=lambda plan, tiles, rank: layout_shapes(d, tiles, rank))

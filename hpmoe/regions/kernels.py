"""One torch op per tile task, on views of a rank's buffers.

The exact executor (all ranks in one process) and the multi-rank runtime run the
same functions.  ``KERNELS`` maps every non-put forward ``TaskKind`` to its function;
``FORWARD`` is the forward ``Region`` (lowering, kernels, put specs, buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..ir.graph import TaskKind, Tile
from ..refs import gated, topk_sum
from ..routing import Routing, RoutingPlan
from ..spec import PLAIN_GLU, Activation, GluForm, MoESpec, TileSpec
from ..weights import ExpertWeights, Rows
from .base import PutSpec, Region, RegionKind, ShapeMap
from .forward import lower_forward


@dataclass(kw_only=True)
class ExpertBuffers:
    """What one rank's forward buffers hold in every family: x, out, so [T, H]; send the
    rows it sends; recv, y [R, H] its experts' rows; h [R, 2F]; a [R, F]; sh [T, 2Fs];
    sa [T, Fs] (R = rows its experts receive)."""

    x: torch.Tensor
    send: torch.Tensor
    recv: torch.Tensor
    h: torch.Tensor
    a: torch.Tensor
    y: torch.Tensor
    out: torch.Tensor
    sh: torch.Tensor
    sa: torch.Tensor
    so: torch.Tensor


def expert_fields(x: torch.Tensor, moe: MoESpec, sent: int, received: int) -> dict[str, torch.Tensor]:
    """``ExpertBuffers``' fields for tokens ``x`` [T, H], ``sent`` rows sent and
    ``received`` rows its experts read, uninitialised (x itself)."""
    t, h, f, fs = x.shape[0], moe.hidden, moe.ffn, moe.shared_ffn

    def new(rows: int, cols: int) -> torch.Tensor:
        return torch.empty(rows, cols, dtype=moe.dtype, device=x.device)

    return {"x": x, "send": new(sent, h), "recv": new(received, h), "h": new(received, 2 * f),
            "a": new(received, f), "y": new(received, h), "out": new(t, h), "sh": new(t, 2 * fs),
            "sa": new(t, fs), "so": new(t, h)}


@dataclass(kw_only=True)
class ForwardBuffers(ExpertBuffers):
    """One rank's per-expert forward buffers (``ExpertBuffers``; send [T*k, H]) and comb
    [T*k, H], the expert outputs back at the source.  ``recv`` and ``comb`` are the
    symmetric ones: peers put into them."""

    SYMMETRIC: ClassVar[tuple[str, ...]] = ("recv", "comb")

    comb: torch.Tensor

    @staticmethod
    def allocate(x: torch.Tensor, plan: RoutingPlan, rank: int,
                 recv: torch.Tensor | None = None, comb: torch.Tensor | None = None) -> ForwardBuffers:
        """Buffers for ``rank`` holding its tokens ``x`` [T, H]; ``recv``/``comb`` may
        be passed in (views of a symmetric heap), else they are allocated here."""
        rows = x.shape[0] * plan.moe.top_k
        fields = expert_fields(x, plan.moe, rows, plan.recv_rows(rank))
        if recv is not None:
            fields["recv"] = recv
        if comb is None:
            comb = torch.empty(rows, plan.moe.hidden, dtype=plan.moe.dtype, device=x.device)
        return ForwardBuffers(**fields, comb=comb)


@dataclass
class RankContext:
    """Read-only data of one rank: its experts' weights and its slice of the plan.

    w13: [L][2F, H], w2: [L][H, F] (this rank's experts, read in place: ``Rows``);
    token_of_row: [T*k] int64 token of each permuted row; pos: [T, k] int64 permuted row
    of (token, slot); topk_weights: [T, k] float32; b13 [L][2F] / b2 [L][H]: its experts'
    biases, or None."""

    weights: ExpertWeights
    w13: Rows
    w2: Rows
    token_of_row: torch.Tensor
    pos: torch.Tensor
    topk_weights: torch.Tensor
    b13: Rows | None = None
    b2: Rows | None = None

    @staticmethod
    def build(weights: ExpertWeights, plan: RoutingPlan, routing: Routing, rank: int) -> RankContext:
        """Of ``rank`` in a run holding every rank's ``routing``."""
        tpr = plan.par.tokens_per_rank
        return RankContext.of(weights, plan, routing.weights[rank * tpr:(rank + 1) * tpr], rank)

    @staticmethod
    def of(weights: ExpertWeights, plan: RoutingPlan, topk_weights: torch.Tensor, rank: int) -> RankContext:
        """Of ``rank`` given its own tokens' routing weights [T, k]."""
        local, k = plan.local_experts, plan.moe.top_k
        mine = weights.local(slice(rank * local, (rank + 1) * local))
        return RankContext(weights, mine.w13, mine.w2, plan.order[rank] // k, plan.pos[rank], topk_weights,
                           mine.b13, mine.b2)


Kernel = Callable[[Tile, ForwardBuffers, ForwardBuffers, RankContext], None]


def _permute(t: Tile, me: ForwardBuffers, peer: ForwardBuffers, ctx: RankContext) -> None:
    torch.index_select(me.x, 0, ctx.token_of_row[t.row0:t.row1], out=me.send[t.row0:t.row1])


def gemm_bias(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = a @ w.T (+ bias, as ``F.linear`` adds it), written into ``out``."""
    if bias is None:
        torch.mm(a, w.t(), out=out)
    else:
        torch.addmm(bias, a, w.t(), out=out)


def _bias(b: Rows | None, expert: int, col0: int, col1: int) -> torch.Tensor | None:
    return None if b is None else b[expert][col0:col1]


def _gemm_up(t: Tile, me: ForwardBuffers, peer: ForwardBuffers, ctx: RankContext) -> None:
    w = ctx.w13[t.expert][t.col0:t.col1]
    gemm_bias(me.recv[t.row0:t.row1], w, _bias(ctx.b13, t.expert, t.col0, t.col1),
              me.h[t.row0:t.row1, t.col0:t.col1])


ACTIVATIONS_INTO: dict[Activation, Callable[[torch.Tensor, torch.Tensor], object]] = {
    Activation.SILU: lambda x, out: torch.ops.aten.silu.out(x, out=out),
    Activation.GELU: lambda x, out: torch.ops.aten.gelu.out(x, out=out),
    Activation.GELU_TANH: lambda x, out: torch.ops.aten.gelu.out(x, approximate="tanh", out=out),
    Activation.RELU: lambda x, out: torch.clamp_min(x, 0, out=out),
}  # act(x) written into ``out`` (the functional ops' bits, no temporary)


def glu(h: torch.Tensor, out: torch.Tensor, activation: Activation, form: GluForm = PLAIN_GLU) -> None:
    """out [m, F] = act(h[:, :F]) * h[:, F:] for h [m, 2F] (SwiGLU for SILU); another
    ``form`` (clamped, interleaved: GPT-OSS) is ``refs.gated``'s bits."""
    if not form.plain:
        out.copy_(gated(h, activation, form))
        return
    f = out.shape[1]
    ACTIVATIONS_INTO[activation](h[:, :f], out)
    out.mul_(h[:, f:])


def _swiglu(t: Tile, me: ForwardBuffers, peer: ForwardBuffers, ctx: RankContext) -> None:
    spec = ctx.weights.spec
    glu(me.h[t.row0:t.row1], me.a[t.row0:t.row1], spec.activation, spec.glu)


def _gemm_down(t: Tile, me: ForwardBuffers, peer: ForwardBuffers, ctx: RankContext) -> None:
    w = ctx.w2[t.expert][t.col0:t.col1]
    gemm_bias(me.a[t.row0:t.row1], w, _bias(ctx.b2, t.expert, t.col0, t.col1),
              me.y[t.row0:t.row1, t.col0:t.col1])


def _unpermute(t: Tile, me: ForwardBuffers, peer: ForwardBuffers, ctx: RankContext) -> None:
    shared = me.so[t.row0:t.row1] if ctx.weights.has_shared else None
    rows = me.comb[ctx.pos[t.row0:t.row1]]  # [m, k, H]
    me.out[t.row0:t.row1] = topk_sum(rows, ctx.topk_weights[t.row0:t.row1], shared, me.out.dtype)


def _shared_up(t: Tile, me: ForwardBuffers, peer: ForwardBuffers, ctx: RankContext) -> None:
    w = ctx.weights.shared_w13[t.col0:t.col1]
    torch.mm(me.x[t.row0:t.row1], w.t(), out=me.sh[t.row0:t.row1, t.col0:t.col1])


def _shared_swiglu(t: Tile, me: ForwardBuffers, peer: ForwardBuffers, ctx: RankContext) -> None:
    glu(me.sh[t.row0:t.row1], me.sa[t.row0:t.row1], ctx.weights.spec.activation)


def _shared_down(t: Tile, me: ForwardBuffers, peer: ForwardBuffers, ctx: RankContext) -> None:
    w = ctx.weights.shared_w2[t.col0:t.col1]
    torch.mm(me.sa[t.row0:t.row1], w.t(), out=me.so[t.row0:t.row1, t.col0:t.col1])


KERNELS: dict[TaskKind, Kernel] = {
    TaskKind.PERMUTE: _permute, TaskKind.GEMM_UP: _gemm_up, TaskKind.SWIGLU: _swiglu,
    TaskKind.GEMM_DOWN: _gemm_down, TaskKind.UNPERMUTE: _unpermute, TaskKind.SHARED_UP: _shared_up,
    TaskKind.SHARED_SWIGLU: _shared_swiglu, TaskKind.SHARED_DOWN: _shared_down,
}


def forward_symmetric_shapes(plan: RoutingPlan, tiles: TileSpec, rank: int) -> ShapeMap:
    """recv [R_rank, H] and comb [T*k, H] in the layer's dtype."""
    moe, t = plan.moe, plan.par.tokens_per_rank
    return {"recv": ((plan.recv_rows(rank), moe.hidden), moe.dtype),
            "comb": ((t * moe.top_k, moe.hidden), moe.dtype)}


FORWARD = Region(
    kind=RegionKind.FORWARD, lower=lower_forward, kernels=KERNELS,
    puts={TaskKind.DISPATCH: PutSpec(src="send", dst="recv"), TaskKind.COMBINE: PutSpec(src="y", dst="comb")},
    buffers=ForwardBuffers, symmetric_shapes=forward_symmetric_shapes)

"""One torch op per backward tile task, on views of a rank's buffers.

``BACKWARD_KERNELS`` maps every backward ``TaskKind`` to ``fn(tile, me, peer, ctx)``,
the signature of the forward ``KERNELS``, so any executor that runs a kernel table
runs the backward graph too.  ``me``/``peer`` are ``BackwardBuffers``; ``grecv`` and
``gcomb`` are its symmetric fields (peers put into them).

Numerics follow autograd through ``refs.dense_moe``: the output gradient of slot j
is ``(w_j * dy.float()).to(dtype)``; SwiGLU backward rounds ``da * up`` to the dtype
before ``silu_backward`` as autograd does; input gradients are summed over slots in
top-k order in fp32 (then the shared-expert term), router gradients are fp32 dots.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..ir.graph import TaskKind, Tile
from ..refs import clamped, glu_halves
from ..routing import RoutingPlan
from ..spec import PLAIN_GLU, Activation, GluForm, TileSpec
from ..weights import ExpertWeights, Rows, rows_shape
from .backward import lower_backward
from .base import PutSpec, Region, RegionKind, ShapeMap
from .kernels import ACTIVATIONS_INTO, ForwardBuffers, glu


@dataclass
class SavedActivations:
    """What one rank keeps from the forward pass for the backward pass.

    x [T, H] (its tokens); xe [R, H] rows received in dispatch; h [R, 2F] expert
    pre-activations; a [R, F] SwiGLU outputs, or None when recomputed; comb [T*k, H]
    expert outputs back at the source (for the router gradient); sh [T, 2Fs] and
    sa [T, Fs] (or None when recomputed) of the shared experts.  All spec.dtype."""

    x: torch.Tensor
    xe: torch.Tensor
    h: torch.Tensor
    a: torch.Tensor | None
    comb: torch.Tensor
    sh: torch.Tensor
    sa: torch.Tensor | None

    @staticmethod
    def from_forward(buf: ForwardBuffers, recompute: bool) -> SavedActivations:
        """Keep the minimal forward buffers of one rank (drop ``a``/``sa`` when recomputing)."""
        return SavedActivations(x=buf.x, xe=buf.recv, h=buf.h, a=None if recompute else buf.a,
                                comb=buf.comb, sh=buf.sh, sa=None if recompute else buf.sa)

    def nbytes(self) -> int:
        """Bytes held by the saved tensors (``x`` excluded: the caller owns it)."""
        kept = [self.xe, self.h, self.a, self.comb, self.sh, self.sa]
        return sum(t.numel() * t.element_size() for t in kept if t is not None)


@dataclass(kw_only=True)
class GradientBuffers:
    """What one rank's backward buffers hold in every family: the saved activations
    (the family's ``saved_kind``) plus gradients.

    dy [T, H] output gradient; gsend the output-gradient rows it sends; grecv [R, H] the
    output-gradient rows its experts read; da [R, F]; dh [R, 2F]; dxe [R, H] expert input
    gradients; dx [T, H]; dw [T, k] float32 routing-weight gradient; dw13 [L][2F, H],
    dw2 [L][H, F] local expert gradients (zero for experts without rows; ``Rows``: where
    each expert's gradient lands, ``SlotGradients.views``); sda [T, Fs], sdh [T, 2Fs],
    sdx [T, H], dsw13 [2Fs, H], dsw2 [H, Fs] shared; db13 [L][2F], db2 [L][H] the expert
    biases' gradients (None without biases).  All spec.dtype except ``dw``."""

    saved: Any
    dy: torch.Tensor
    gsend: torch.Tensor
    grecv: torch.Tensor
    da: torch.Tensor
    dh: torch.Tensor
    dxe: torch.Tensor
    dx: torch.Tensor
    dw: torch.Tensor
    dw13: Rows
    dw2: Rows
    sda: torch.Tensor
    sdh: torch.Tensor
    sdx: torch.Tensor
    dsw13: torch.Tensor
    dsw2: torch.Tensor
    db13: Rows | None = None
    db2: Rows | None = None


@dataclass(kw_only=True)
class BackwardBuffers(GradientBuffers):
    """One rank's per-expert backward buffers (``GradientBuffers``): gsend [T*k, H] w_j * dy
    rows in permuted order; grecv (symmetric) the received ones; gcomb [T*k, H] (symmetric)
    input gradients back at the source."""

    SYMMETRIC: ClassVar[tuple[str, ...]] = ("grecv", "gcomb")
    saved: SavedActivations
    gcomb: torch.Tensor

    @staticmethod
    def allocate(saved: SavedActivations, dy: torch.Tensor, plan: RoutingPlan,
                 views: Mapping[str, torch.Tensor | Rows] | None = None) -> BackwardBuffers:
        """Buffers for one rank holding dy [T, H].  ``views`` may supply any gradient
        field — ``grecv``/``gcomb`` in a symmetric heap, ``dx``/``dw`` as slices of full-size
        outputs, ``dw13``/``dw2`` (``db13``/``db2``) the rows of zero-filled ones
        (``SlotGradients.views``) — the rest is allocated
        here, as are recomputed ``a``/``sa`` (``saved`` itself is not modified)."""
        shapes = gradient_shapes(plan, dy.shape[0], saved.xe.shape[0])
        views = dict(views or {})
        _check_views(views, shapes)
        bufs = {name: views[name] if name in views else _new(field, dy.device)
                for name, field in shapes.items()}
        dtype, (r, f), (t, fs) = plan.moe.dtype, shapes["da"][0], shapes["sda"][0]
        full = SavedActivations(x=saved.x, xe=saved.xe, h=saved.h, comb=saved.comb, sh=saved.sh,
                                a=_or_new(saved.a, (r, f), dtype, dy.device),
                                sa=_or_new(saved.sa, (t, fs), dtype, dy.device))
        return BackwardBuffers(saved=full, dy=dy, **bufs)


FieldSpec = tuple[tuple[int, ...], torch.dtype, bool]


def gradient_shapes(plan: RoutingPlan, tokens: int, rows: int) -> dict[str, FieldSpec]:
    """(shape, dtype, zero-filled) of every gradient field of ``BackwardBuffers`` for a
    rank with ``tokens`` tokens that received ``rows`` rows."""
    moe = plan.moe
    t, r, k, h, f, fs, el, d = (tokens, rows, moe.top_k, moe.hidden, moe.ffn, moe.shared_ffn,
                                plan.local_experts, moe.dtype)
    shapes = {"gsend": ((t * k, h), d, False), "grecv": ((r, h), d, False), "da": ((r, f), d, False),
              "dh": ((r, 2 * f), d, False), "dxe": ((r, h), d, False), "gcomb": ((t * k, h), d, False),
              "dx": ((t, h), d, False), "dw": ((t, k), torch.float32, False),
              "dw13": ((el, 2 * f, h), d, True), "dw2": ((el, h, f), d, True), "sda": ((t, fs), d, False),
              "sdh": ((t, 2 * fs), d, False), "sdx": ((t, h), d, False), "dsw13": ((2 * fs, h), d, True),
              "dsw2": ((h, fs), d, True)}
    return {**shapes, **bias_gradient_shapes(plan)}


def bias_gradient_shapes(plan: RoutingPlan) -> dict[str, FieldSpec]:
    """db13 [L, 2F] and db2 [L, H] (zero-filled) when the experts carry biases, else none."""
    moe, el = plan.moe, plan.local_experts
    if not moe.expert_bias:
        return {}
    return {"db13": ((el, 2 * moe.ffn), moe.dtype, True), "db2": ((el, moe.hidden), moe.dtype, True)}


def _new(field: FieldSpec, device: torch.device) -> torch.Tensor:
    shape, dtype, zero = field
    if zero:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _or_new(given: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """``given``, or an empty tensor to recompute into."""
    return torch.empty(shape, dtype=dtype, device=device) if given is None else given


def _check_views(views: Mapping[str, torch.Tensor | Rows], shapes: Mapping[str, FieldSpec]) -> None:
    for name, view in views.items():
        if name not in shapes:
            raise ValueError(f"views[{name!r}]: not a gradient field, expected one of {sorted(shapes)}")
        shape, dtype, _ = shapes[name]
        got, got_dtype = rows_shape(view), (view if isinstance(view, torch.Tensor) else view[0]).dtype
        if got != shape or got_dtype != dtype:
            raise ValueError(f"views[{name!r}] is {got} {got_dtype}, expected {shape} {dtype}")


@dataclass
class BackwardContext:
    """Read-only data of one rank for the backward kernels.

    w13 [L][2F, H], w2 [L][H, F]: this rank's experts (read in place); shared_w13 [2Fs, H] and
    shared_w2 [H, Fs] or None; token_of_row [T*k] int64 token of each permuted row;
    row_weight [T*k] float32 routing weight of each permuted row; pos [T, k] int64
    permuted row of (token, slot); activation, glu: the experts' gated activation."""

    w13: Rows
    w2: Rows
    shared_w13: torch.Tensor | None
    shared_w2: torch.Tensor | None
    token_of_row: torch.Tensor
    row_weight: torch.Tensor
    pos: torch.Tensor
    activation: Activation = Activation.SILU
    glu: GluForm = PLAIN_GLU

    @staticmethod
    def build(weights: ExpertWeights, plan: RoutingPlan, topk_weights: torch.Tensor,
              rank: int) -> BackwardContext:
        """``topk_weights``: [T, k] float32 routing weights of ``rank``'s tokens."""
        local, k = plan.local_experts, plan.moe.top_k
        mine = weights.local(slice(rank * local, (rank + 1) * local))
        order = plan.order[rank]
        return BackwardContext(w13=mine.w13, w2=mine.w2,
                               shared_w13=weights.shared_w13, shared_w2=weights.shared_w2,
                               token_of_row=order // k, row_weight=topk_weights.reshape(-1)[order],
                               pos=plan.pos[rank], activation=weights.spec.activation, glu=weights.spec.glu)


BackwardKernel = Callable[[Tile, BackwardBuffers, BackwardBuffers, BackwardContext], None]


ACTIVATION_GRADS_INTO: dict[Activation, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]] = {
    Activation.SILU: lambda g, x, out: torch.ops.aten.silu_backward.grad_input(g, x, grad_input=out),
    Activation.GELU: lambda g, x, out: torch.ops.aten.gelu_backward.grad_input(g, x, grad_input=out),
    Activation.GELU_TANH: lambda g, x, out: torch.ops.aten.gelu_backward.grad_input(
        g, x, approximate="tanh", grad_input=out),
    Activation.RELU: lambda g, x, out: torch.ops.aten.threshold_backward.grad_input(g, x, 0, grad_input=out),
}  # the activations' backward ops, writing into ``out``


def glu_backward(h: torch.Tensor, da: torch.Tensor, dh: torch.Tensor, activation: Activation,
                 tmp: torch.Tensor | None = None, form: GluForm = PLAIN_GLU) -> None:
    """dh [m, 2F] = gradient of act(h[:, :F]) * h[:, F:] given da [m, F], as autograd
    computes it (``da * up`` rounded to the dtype, then the activation's backward op);
    tmp: [m, F] scratch of da's dtype (None: a fresh one).  Another ``form`` (clamped,
    interleaved) is autograd's gradient of ``refs.gated``."""
    if not form.plain:
        _form_backward(h, da, dh, activation, form)
        return
    f = da.shape[1]
    gate, up = h[:, :f], h[:, f:]
    tmp = torch.empty_like(da) if tmp is None else tmp
    torch.mul(da, up, out=tmp)
    ACTIVATION_GRADS_INTO[activation](tmp, gate, dh[:, :f])
    ACTIVATIONS_INTO[activation](gate, tmp)
    torch.mul(da, tmp, out=dh[:, f:])


def _form_backward(h: torch.Tensor, da: torch.Tensor, dh: torch.Tensor, activation: Activation,
                   form: GluForm) -> None:
    """``glu_backward`` of a non-plain ``form`` (``refs.gated``'s gradient), in fp32: clamped
    values pass no gradient, as ``clamp``'s backward does."""
    gate, up = glu_halves(h, form)
    d_gate, d_up = glu_halves(dh, form)
    g, u = clamped(gate.float(), up.float(), form)
    da = da.float()
    if form.alpha != 1.0:
        sig = torch.sigmoid(form.alpha * g)
        act, slope = g * sig, sig + form.alpha * g * sig * (1 - sig)
    else:
        act, slope = torch.empty_like(g), torch.empty_like(g)
        ACTIVATIONS_INTO[activation](g, act)
        ACTIVATION_GRADS_INTO[activation](torch.ones_like(g), g, slope)
    dg, du = da * (u + form.up_shift) * slope, da * act
    if form.limit is not None:
        dg = dg * (gate <= form.limit)
        du = du * ((up >= -form.limit) & (up <= form.limit))
    d_gate.copy_(dg)
    d_up.copy_(du)


def _grad_permute(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    rows = slice(t.row0, t.row1)
    g = me.dy.index_select(0, ctx.token_of_row[rows]).float() * ctx.row_weight[rows, None]
    me.gsend[rows].copy_(g)


def _dgrad_down(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    w = ctx.w2[t.expert][:, t.col0:t.col1]
    torch.mm(me.grecv[t.row0:t.row1], w, out=me.da[t.row0:t.row1, t.col0:t.col1])


def _swiglu_bwd(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    rows = slice(t.row0, t.row1)
    glu_backward(me.saved.h[rows], me.da[rows], me.dh[rows], ctx.activation, form=ctx.glu)


def _dgrad_up(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    w = ctx.w13[t.expert][:, t.col0:t.col1]
    torch.mm(me.dh[t.row0:t.row1], w, out=me.dxe[t.row0:t.row1, t.col0:t.col1])


def _wgrad_down(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    g = me.grecv[t.row0:t.row1, t.col0:t.col1]
    torch.mm(g.t(), me.saved.a[t.row0:t.row1], out=me.dw2[t.expert][t.col0:t.col1])
    if me.db2 is not None:  # the tile holds every row of its expert
        torch.sum(g, 0, out=me.db2[t.expert][t.col0:t.col1])


def _wgrad_up(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    g = me.dh[t.row0:t.row1, t.col0:t.col1]
    torch.mm(g.t(), me.saved.xe[t.row0:t.row1], out=me.dw13[t.expert][t.col0:t.col1])
    if me.db13 is not None:
        torch.sum(g, 0, out=me.db13[t.expert][t.col0:t.col1])


def _grad_unpermute(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    """dx[tokens] = sum over slots (top-k order) of the input-gradient rows, in fp32,
    then the shared-expert input gradient."""
    pos = ctx.pos[t.row0:t.row1]
    acc = torch.zeros(pos.shape[0], me.dx.shape[1], dtype=torch.float32, device=me.dx.device)
    for j in range(pos.shape[1]):
        acc += me.gcomb[pos[:, j]].float()
    if ctx.shared_w13 is not None:
        acc += me.sdx[t.row0:t.row1].float()
    me.dx[t.row0:t.row1].copy_(acc)


def _router_grad(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    """dw[t, j] = <dy[t], o_j[t]> in fp32; o_j from the saved combine buffer."""
    o = me.saved.comb[ctx.pos[t.row0:t.row1]].float()  # [m, k, H]
    dy = me.dy[t.row0:t.row1].float().unsqueeze(1)
    torch.sum(dy * o, dim=2, out=me.dw[t.row0:t.row1])


def _recompute(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    """Routed expert rows (expert >= 0) or shared rows (expert -1): a = act(gate) * up."""
    s = me.saved
    h, a, form = (s.h, s.a, ctx.glu) if t.expert >= 0 else (s.sh, s.sa, PLAIN_GLU)
    glu(h[t.row0:t.row1], a[t.row0:t.row1], ctx.activation, form)


def _shared_dgrad_down(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    w = ctx.shared_w2[:, t.col0:t.col1]
    torch.mm(me.dy[t.row0:t.row1], w, out=me.sda[t.row0:t.row1, t.col0:t.col1])


def _shared_swiglu_bwd(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    glu_backward(me.saved.sh[t.row0:t.row1], me.sda[t.row0:t.row1], me.sdh[t.row0:t.row1], ctx.activation)


def _shared_dgrad_up(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    w = ctx.shared_w13[:, t.col0:t.col1]
    torch.mm(me.sdh[t.row0:t.row1], w, out=me.sdx[t.row0:t.row1, t.col0:t.col1])


def _shared_wgrad_down(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    g = me.dy[t.row0:t.row1, t.col0:t.col1]
    torch.mm(g.t(), me.saved.sa[t.row0:t.row1], out=me.dsw2[t.col0:t.col1])


def _shared_wgrad_up(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    g = me.sdh[t.row0:t.row1, t.col0:t.col1]
    torch.mm(g.t(), me.saved.x[t.row0:t.row1], out=me.dsw13[t.col0:t.col1])


BACKWARD_KERNELS: dict[TaskKind, BackwardKernel] = {
    TaskKind.GRAD_PERMUTE: _grad_permute,
    TaskKind.DGRAD_DOWN: _dgrad_down, TaskKind.WGRAD_DOWN: _wgrad_down,
    TaskKind.SWIGLU_BWD: _swiglu_bwd, TaskKind.DGRAD_UP: _dgrad_up, TaskKind.WGRAD_UP: _wgrad_up,
    TaskKind.GRAD_UNPERMUTE: _grad_unpermute,
    TaskKind.ROUTER_GRAD: _router_grad, TaskKind.SWIGLU_RECOMPUTE: _recompute,
    TaskKind.SHARED_DGRAD_DOWN: _shared_dgrad_down, TaskKind.SHARED_SWIGLU_BWD: _shared_swiglu_bwd,
    TaskKind.SHARED_DGRAD_UP: _shared_dgrad_up, TaskKind.SHARED_WGRAD_DOWN: _shared_wgrad_down,
    TaskKind.SHARED_WGRAD_UP: _shared_wgrad_up,
}


def backward_symmetric_shapes(plan: RoutingPlan, tiles: TileSpec, rank: int) -> ShapeMap:
    """grecv [R_rank, H] and gcomb [T*k, H] in the layer's dtype."""
    moe, t = plan.moe, plan.par.tokens_per_rank
    return {"grecv": ((plan.recv_rows(rank), moe.hidden), moe.dtype),
            "gcomb": ((t * moe.top_k, moe.hidden), moe.dtype)}


def _backward_region(recompute: bool) -> Region:
    return Region(
        kind=RegionKind.BACKWARD_RECOMPUTE if recompute else RegionKind.BACKWARD,
        lower=functools.partial(lower_backward, recompute=recompute), kernels=BACKWARD_KERNELS,
        puts={TaskKind.GRAD_DISPATCH: PutSpec(src="gsend", dst="grecv"),
              TaskKind.GRAD_COMBINE: PutSpec(src="dxe", dst="gcomb")},
        buffers=BackwardBuffers, symmetric_shapes=backward_symmetric_shapes)


BACKWARD = _backward_region(recompute=False)
BACKWARD_RECOMPUTE = _backward_region(recompute=True)

"""One torch op per backward tile task, on views of a rank's buffers.

``BACKWARD_KERNELS`` maps every backward ``TaskKind`` to ``fn(tile, me, peer, ctx)``,
the signature of the forward ``KERNELS``, so any executor that runs a kernel table
runs the backward graph too.  ``me``/``peer`` are ``BackwardBuffers``; ``grecv`` and
``gcomb`` are its symmetric fields (peers put into them).

The rows travel unweighted, each with one float32 riding after its H elements
(``rider``): a dy row carries its routing weight w to the expert, an input-gradient row
carries back its router-weight gradient ds.  The expert computes d = dy @ W2, then
``glu_router_backward`` (kernel by kernel's numerics): ds = <d, act(h)> (+ <dy, b2> with
biases; SonicMoE's <dO W2, A>: no expert output is kept), da = w * d rounded to the
dtype, the gated activation's gradient as autograd rounds it, and a_w = w * act(h)
rounded, the down projection's weight-gradient operand.  Input gradients are summed over
slots in top-k order in fp32 (then the shared-expert term).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from ..deprecation import deprecated
from ..ir.graph import TaskKind, Tile
from ..refs import clamped, glu_halves
from ..routing import RoutingPlan
from ..spec import PLAIN_GLU, Activation, GluForm, MoESpec, TileSpec
from ..weights import ExpertWeights, Rows, rows_shape
from .backward import lower_backward
from .base import Kept, PutSpec, Region, RegionKind, ShapeMap, as_kept
from .kernels import ACTIVATIONS_INTO, ForwardBuffers, glu


@dataclass
class SavedActivations:
    """What one rank keeps from the forward pass for the backward pass.

    x [T, H] (its tokens); xe [R, H] rows received in dispatch (None: they travel again
    beside their dy rows, ``Kept.INPUT``); h [R, 2F] expert pre-activations; sh [T, 2Fs]
    and sa [T, Fs] (or None when recomputed) of the shared experts.  All spec.dtype.
    Neither the experts' gated activation (recomputed from h) nor their outputs (the
    router gradient is <d, act(h)>) are kept."""

    x: torch.Tensor
    xe: torch.Tensor | None
    h: torch.Tensor
    sh: torch.Tensor
    sa: torch.Tensor | None

    @staticmethod
    def from_forward(buf: ForwardBuffers | Any, recompute: Kept | bool) -> SavedActivations:
        """Keep what ``recompute`` (``base.as_kept``) says of one rank's forward buffers,
        per expert or deduplicated (both name them alike)."""
        kept = as_kept(recompute)
        return SavedActivations(x=buf.x, xe=None if kept.travels else buf.recv, h=buf.h, sh=buf.sh,
                                sa=buf.sa if kept is Kept.ALL else None)

    @property
    def travels(self) -> bool:
        """Whether the experts' input rows travel again beside their dy rows."""
        return self.xe is None

    def nbytes(self) -> int:
        """Bytes held by the saved tensors (``x`` excluded: the caller owns it)."""
        kept = [self.xe, self.h, self.sh, self.sa]
        return sum(t.numel() * t.element_size() for t in kept if t is not None)


@dataclass(kw_only=True)
class GradientBuffers:
    """What one rank's backward buffers hold in every family: the saved activations
    (``SavedActivations``) plus gradients.

    dy [T, H] output gradient; gsend the output-gradient rows it sends; grecv [R, W] the
    output-gradient rows its experts read, each with its routing weight riding
    (``rider``; W = ``row_width(H)``); da [R, F] (first d = dy @ W2); aw [R, F] w * act(h);
    dh [R, 2F]; dxe [R, W] expert input gradients, each with its router-weight gradient
    riding; dx [T, H]; dw [T, k] float32 routing-weight gradient; dw13 [L][2F, H],
    dw2 [L][H, F] local expert gradients (zero for experts without rows; ``Rows``: where
    each expert's gradient lands, ``SlotGradients.views``); sda [T, Fs], sdh [T, 2Fs],
    sdx [T, H], dsw13 [2Fs, H], dsw2 [H, Fs] shared; db13 [L][2F], db2 [L][H] the expert
    biases' gradients (None without biases).  All spec.dtype except ``dw``."""

    saved: Any
    dy: torch.Tensor
    gsend: torch.Tensor
    grecv: torch.Tensor
    da: torch.Tensor
    aw: torch.Tensor
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
    """One rank's per-expert backward buffers (``GradientBuffers``): gsend [T*k, W] dy rows
    in permuted order with their routing weights riding; grecv (symmetric) the received
    ones; gcomb [T*k, W] (symmetric) input gradients back at the source, with the router
    gradients riding."""

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
        shapes = gradient_shapes(plan.moe, plan.local_experts, dy.shape[0], saved.h.shape[0], saved.travels)
        full, bufs = gradient_fields(shapes, saved, dy, views)
        return BackwardBuffers(saved=full, dy=dy, **bufs)


FieldSpec = tuple[tuple[int, ...], torch.dtype, bool]

ROW_TAIL = 8  # elements after a travelling row's H (16 bytes at bf16): one float32 rides there


def row_width(hidden: int, carried: bool = False) -> int:
    """Elements of a dy or input-gradient row that travels: its ``hidden`` (rounded up to
    even, so that the float32 after it is aligned), where ``carried`` the expert's input
    row beside a dy row (likewise rounded), and ``ROW_TAIL``."""
    return (hidden + hidden % 2) * (2 if carried else 1) + ROW_TAIL


def carried_rows(rows: torch.Tensor, hidden: int) -> torch.Tensor:
    """[m, H] the input rows travelling beside dy rows [m, row_width(H, True)], a view."""
    start = hidden + hidden % 2
    return rows[:, start:start + hidden]


def rider(rows: torch.Tensor) -> torch.Tensor:
    """[m] float32: the value riding in rows [m, row_width(H)] (a dy row's routing weight,
    an input-gradient row's router-weight gradient), a view."""
    return rows[:, -ROW_TAIL:].view(torch.float32)[:, 0]


def gradient_shapes(moe: MoESpec, local_experts: int, tokens: int, rows: int, carried: bool = False,
                    sent: int | None = None) -> dict[str, FieldSpec]:
    """(shape, dtype, zero-filled) of every gradient field of ``BackwardBuffers`` for a
    rank of ``local_experts`` experts with ``tokens`` tokens that received ``rows`` rows
    (``carried``: the input rows travel beside the dy rows); ``sent``: rows it sends and
    gets back (None: tokens x top-k)."""
    t, r, k, h, f, fs, el, d = (tokens, rows, moe.top_k, moe.hidden, moe.ffn, moe.shared_ffn,
                                local_experts, moe.dtype)
    w, wg, s = row_width(h), row_width(h, carried), t * k if sent is None else sent
    shapes = {"gsend": ((s, wg), d, False), "grecv": ((r, wg), d, False), "da": ((r, f), d, False),
              "aw": ((r, f), d, False), "dh": ((r, 2 * f), d, False), "dxe": ((r, w), d, False),
              "gcomb": ((s, w), d, False),
              "dx": ((t, h), d, False), "dw": ((t, k), torch.float32, False),
              "dw13": ((el, 2 * f, h), d, True), "dw2": ((el, h, f), d, True), "sda": ((t, fs), d, False),
              "sdh": ((t, 2 * fs), d, False), "sdx": ((t, h), d, False), "dsw13": ((2 * fs, h), d, True),
              "dsw2": ((h, fs), d, True)}
    return {**shapes, **_bias_gradient_shapes(moe, el)}


def bias_gradient_shapes(plan: RoutingPlan) -> dict[str, FieldSpec]:
    """Deprecated: ``gradient_shapes`` holds the bias fields (goes in the next release)."""
    deprecated("regions.backward_kernels.bias_gradient_shapes",
               "gradient_shapes(moe, local_experts, ...) holds db13/db2")
    return _bias_gradient_shapes(plan.moe, plan.local_experts)


def _bias_gradient_shapes(moe: MoESpec, el: int) -> dict[str, FieldSpec]:
    """db13 [L, 2F] and db2 [L, H] (zero-filled) when the experts carry biases, else none."""
    if not moe.expert_bias:
        return {}
    return {"db13": ((el, 2 * moe.ffn), moe.dtype, True), "db2": ((el, moe.hidden), moe.dtype, True)}


def _new(field: FieldSpec, device: torch.device) -> torch.Tensor:
    shape, dtype, zero = field
    if zero:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def gradient_fields(shapes: Mapping[str, FieldSpec], saved: SavedActivations, dy: torch.Tensor,
                    views: Mapping[str, torch.Tensor | Rows] | None) -> tuple[SavedActivations, dict]:
    """Every field of ``shapes``: the given ``views`` (checked against their shapes), the
    rest allocated on dy's device; and ``saved`` with a place to recompute the shared
    activation into where it was not kept (``saved`` itself is not modified)."""
    views = dict(views or {})
    _check_views(views, shapes)
    made = {name: views[name] if name in views else _new(field, dy.device) for name, field in shapes.items()}
    sa = saved.sa if saved.sa is not None else _new((shapes["sda"][0], dy.dtype, False), dy.device)
    return replace(saved, sa=sa), made


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
    permuted row of (token, slot); activation, glu: the experts' gated activation; b2
    [L][H] the experts' down biases (None without biases: a bias adds <dy, b2> to ds)."""

    w13: Rows
    w2: Rows
    shared_w13: torch.Tensor | None
    shared_w2: torch.Tensor | None
    token_of_row: torch.Tensor
    row_weight: torch.Tensor
    pos: torch.Tensor
    activation: Activation = Activation.SILU
    glu: GluForm = PLAIN_GLU
    b2: Rows | None = None

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
                               pos=plan.pos[rank], activation=weights.spec.activation, glu=weights.spec.glu,
                               b2=mine.b2)


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


def glu_router_backward(h: torch.Tensor, d: torch.Tensor, w: torch.Tensor | None, dh: torch.Tensor,
                        a_w: torch.Tensor, activation: Activation, form: GluForm = PLAIN_GLU
                        ) -> torch.Tensor | None:
    """The experts' backward between their GEMMs, from the pre-activation h [M, 2F], d [M, F]
    (the rows' unweighted output gradient times W2) and w [M] fp32 (each row's routing
    weight; None: 1, the shared expert): dh [M, 2F], the gated activation's gradient of
    da = w * d (rounded to d's dtype); a_w [M, F] = w * act(h) rounded (dW2's operand:
    sum_r (w_r g_r)^T a_r = sum_r g_r^T (w_r a_r)); returns ds [M] fp32 = <d_r, act(h_r)>,
    the gradient of the row's routing weight (the expert output is never kept: SonicMoE's
    <dO W2, A>), or None without weights.  The activation is recomputed from h."""
    act = torch.empty_like(a_w)
    glu(h, act, activation, form)
    if w is None:
        glu_backward(h, d, dh, activation, None, form)
        a_w.copy_(act)
        return None
    ds = (d.float() * act.float()).sum(1)
    scale = w.unsqueeze(1)
    glu_backward(h, (d.float() * scale).to(d.dtype), dh, activation, None, form)
    a_w.copy_(act.float() * scale)
    return ds


def _grad_permute(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    rows, h = slice(t.row0, t.row1), me.dy.shape[1]
    tokens = ctx.token_of_row[rows]
    me.gsend[rows, :h].copy_(me.dy.index_select(0, tokens))
    if me.saved.travels:
        carried_rows(me.gsend[rows], h).copy_(me.saved.x.index_select(0, tokens))
    rider(me.gsend[rows]).copy_(ctx.row_weight[rows])


def _expert_inputs(me: GradientBuffers, rows: slice) -> torch.Tensor:
    """[m, H] the experts' input rows ``rows``: kept, or arrived beside their dy rows."""
    if me.saved.travels:
        return carried_rows(me.grecv[rows], me.dy.shape[1])
    return me.saved.xe[rows]


def _dgrad_down(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    """d = dy @ W2 of the unweighted rows, into ``da`` (``_swiglu_bwd`` weighs it)."""
    w = ctx.w2[t.expert][:, t.col0:t.col1]
    torch.mm(me.grecv[t.row0:t.row1, :w.shape[0]], w, out=me.da[t.row0:t.row1, t.col0:t.col1])


def _swiglu_bwd(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    """dh and aw of the rows from d, their routing weights and h; their router-weight
    gradients ride back with their input gradients."""
    rows = slice(t.row0, t.row1)
    g = me.grecv[rows]
    ds = glu_router_backward(me.saved.h[rows], me.da[rows], rider(g), me.dh[rows], me.aw[rows],
                             ctx.activation, ctx.glu)
    if ctx.b2 is not None:  # the expert output's bias term: <dy, b2>
        ds += g[:, :me.dy.shape[1]].float() @ ctx.b2[t.expert].float()
    rider(me.dxe[rows]).copy_(ds)


def _dgrad_up(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    w = ctx.w13[t.expert][:, t.col0:t.col1]
    torch.mm(me.dh[t.row0:t.row1], w, out=me.dxe[t.row0:t.row1, t.col0:t.col1])


def _wgrad_down(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    """dW2[cols] = dy[:, cols].T @ (w * act(h)); db2[cols] = sum of w * dy[:, cols]."""
    rows = slice(t.row0, t.row1)
    g = me.grecv[rows, t.col0:t.col1]
    torch.mm(g.t(), me.aw[rows], out=me.dw2[t.expert][t.col0:t.col1])
    if me.db2 is not None:  # the tile holds every row of its expert
        weighted = (g.float() * rider(me.grecv[rows]).unsqueeze(1)).to(g.dtype)
        torch.sum(weighted, 0, out=me.db2[t.expert][t.col0:t.col1])


def _wgrad_up(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    g = me.dh[t.row0:t.row1, t.col0:t.col1]
    torch.mm(g.t(), _expert_inputs(me, slice(t.row0, t.row1)), out=me.dw13[t.expert][t.col0:t.col1])
    if me.db13 is not None:
        torch.sum(g, 0, out=me.db13[t.expert][t.col0:t.col1])


def _grad_unpermute(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    """dx[tokens] = sum over slots (top-k order) of the input-gradient rows, in fp32,
    then the shared-expert input gradient."""
    pos, h = ctx.pos[t.row0:t.row1], me.dx.shape[1]
    acc = torch.zeros(pos.shape[0], h, dtype=torch.float32, device=me.dx.device)
    for j in range(pos.shape[1]):
        acc += me.gcomb[pos[:, j], :h].float()
    if ctx.shared_w13 is not None:
        acc += me.sdx[t.row0:t.row1].float()
    me.dx[t.row0:t.row1].copy_(acc)


def _router_grad(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    """dw[t, j]: the router-weight gradient that came back riding with slot j's row."""
    me.dw[t.row0:t.row1] = rider(me.gcomb)[ctx.pos[t.row0:t.row1]]


def _recompute(t: Tile, me: BackwardBuffers, peer: BackwardBuffers, ctx: BackwardContext) -> None:
    """The shared experts' rows: sa = act(gate) * up (the routed experts' activation is
    recomputed where it is read, ``_swiglu_bwd``)."""
    glu(me.saved.sh[t.row0:t.row1], me.saved.sa[t.row0:t.row1], ctx.activation, PLAIN_GLU)


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


def backward_symmetric_shapes(plan: RoutingPlan, tiles: TileSpec, rank: int, carried: bool = False
                              ) -> ShapeMap:
    """grecv [R_rank, row_width(H, carried)] and gcomb [T*k, row_width(H)] in the layer's dtype."""
    moe, t = plan.moe, plan.par.tokens_per_rank
    return {"grecv": ((plan.recv_rows(rank), row_width(moe.hidden, carried)), moe.dtype),
            "gcomb": ((t * moe.top_k, row_width(moe.hidden)), moe.dtype)}


_KINDS = {Kept.ALL: RegionKind.BACKWARD, Kept.ROWS: RegionKind.BACKWARD_RECOMPUTE,
          Kept.INPUT: RegionKind.BACKWARD_REGATHER}


def _backward_region(kept: Kept) -> Region:
    return Region(
        kind=_KINDS[kept], lower=functools.partial(lower_backward, recompute=kept), kernels=BACKWARD_KERNELS,
        puts={TaskKind.GRAD_DISPATCH: PutSpec(src="gsend", dst="grecv"),
              TaskKind.GRAD_COMBINE: PutSpec(src="dxe", dst="gcomb")},
        buffers=BackwardBuffers,
        symmetric_shapes=functools.partial(backward_symmetric_shapes, carried=kept.travels))


BACKWARDS = {k: _backward_region(k) for k in Kept}
BACKWARD, BACKWARD_RECOMPUTE, BACKWARD_REGATHER = BACKWARDS.values()

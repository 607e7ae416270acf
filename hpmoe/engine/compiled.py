"""The region as ``torch.library`` custom ops, for ``torch.compile``.

``hpmoe::region`` (forward) and ``hpmoe::region_backward`` carry only tensors and plain
numbers, have fake (meta) implementations giving their output shapes, and are tied by
``register_autograd``: a model whose hpmoe layers run in one process (virtual EP, exact
backend) compiles with ``fullgraph=True`` and no graph break from hpmoe.  The layer takes
this path while ``torch.compiler.is_compiling()``; eager runs keep ``engine.RegionFunction``.

Each op runs the path ``engine.select`` chooses: with ``auto`` (the layer's
``SchedulePolicy.AUTO``) what AUTO decides for its shape on the saved cpu profile
(the process's decisions, ``engine.PROCESS_AUTO``): the
kernel-by-kernel path or the taskflow, the same in forward and backward.  The backward
op reruns the forward to rebuild the saved activations (a custom op passes no state
from forward to backward but its outputs), then runs the backward: the cost of
``recompute`` plus one forward region per step.  Deduplicated tiles
(``DispatchMode.PER_RANK``/``PER_NODE``) run the deduplicated regions, as in eager.
"""

from __future__ import annotations

import torch

from ..machine import capturing
from ..routing import Routing, check_form, check_input
from ..spec import Activation, DispatchMode, GluForm, MoESpec, TileSpec
from ..weights import ExpertWeights
from .paths import RegionPath
from .selection import compiled_path


def _weights(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, sw13: torch.Tensor,
             sw2: torch.Tensor, b13: torch.Tensor, b2: torch.Tensor, activation: str,
             glu: list[float]) -> ExpertWeights:
    """ExpertWeights of the op's inputs; ``sw13``/``sw2`` of width 0 mean no shared expert,
    ``b13``/``b2`` of width 0 no expert biases; ``glu``: the ``GluForm`` (``_glu_fields``)."""
    e, f2, h = w13.shape
    fs, biased = sw2.shape[1], b13.shape[1] > 0
    interleaved, alpha, limit, shift = glu
    form = GluForm(bool(interleaved), alpha, None if limit < 0 else limit, shift)
    spec = MoESpec(hidden=h, ffn=f2 // 2, experts=e, top_k=ids.shape[1], shared_experts=fs // (f2 // 2),
                   activation=Activation(activation), dtype=x.dtype, glu=form, expert_bias=biased)
    return ExpertWeights.routed(spec, w13, w2, sw13 if fs else None, sw2 if fs else None,
                                b13 if biased else None, b2 if biased else None)


def _glu_fields(form: GluForm) -> list[float]:
    """``form`` as the op's floats (a limit of -1: none)."""
    return [float(form.interleaved), form.alpha, -1.0 if form.limit is None else form.limit, form.up_shift]


_DISPATCH = list(DispatchMode)
_WIRE = [torch.float32, torch.bfloat16]


def _tile_fields(tiles: TileSpec, nodes: int) -> list[int]:
    """``tiles`` and ``nodes`` as the op's plain ints (``_tile_spec`` inverts it).  Identity
    tests: torch.compile guards on them, not on an enum's or dtype's list index."""
    dispatch = [tiles.dispatch is m for m in _DISPATCH].index(True)
    wire = [tiles.partial_dtype is d for d in _WIRE].index(True)
    return [tiles.rows, tiles.gemm_rows, tiles.gemm_cols, tiles.gemm_splits, dispatch, wire, nodes]


def _tile_spec(fields: list[int]) -> tuple[TileSpec, int]:
    rows, gemm_rows, gemm_cols, splits, dispatch, wire, nodes = fields
    return TileSpec(rows, gemm_rows, gemm_cols, splits, _DISPATCH[dispatch], _WIRE[wire]), nodes


def _path(w: ExpertWeights, tokens: int, ep: int, fields: list[int], auto: bool,
          device: torch.device) -> RegionPath:
    """The path of a call on ``device``: AUTO's for this shape with ``auto``, else the
    taskflow."""
    tiles, nodes = _tile_spec(fields)
    return compiled_path(w.spec, tokens, ep, tiles, nodes, auto, device)


@torch.library.custom_op("hpmoe::region", mutates_args=())
def region(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
           sw13: torch.Tensor, sw2: torch.Tensor, b13: torch.Tensor, b2: torch.Tensor, ep: int,
           tiles: list[int], activation: str, glu: list[float], auto: bool) -> torch.Tensor:
    """x [N, H], ids [N, k] int64, weights [N, k] fp32, w13 [E, 2F, H], w2 [E, H, F],
    sw13 [2Fs, H], sw2 [H, Fs] (Fs 0: none), b13 [E, 2F], b2 [E, H] (width 0: none); ep
    virtual ranks dividing N; tiles: the TileSpec fields and the nodes (``_tile_fields``);
    glu: the ``GluForm`` (``_glu_fields``); auto: AUTO picks the path.  Returns [N, H] in
    x's dtype.  The op's call checks its input (the paths check nothing): its values
    only outside a CUDA graph's capture (reading them is a host sync, which a capture
    refuses)."""
    w, routing = _weights(x, ids, w13, w2, sw13, sw2, b13, b2, activation, glu), Routing(ids, weights)
    check_form(x, routing, w.spec)
    if not capturing(x.device):
        check_input(x, routing, w.spec)
    return _path(w, x.shape[0], ep, tiles, auto, x.device).forward(x, routing, w, False)[0]


@region.register_fake
def _(x, ids, weights, w13, w2, sw13, sw2, b13, b2, ep, tiles, activation, glu, auto):
    return torch.empty_like(x)


@torch.library.custom_op("hpmoe::region_backward", mutates_args=())
def region_backward(dy: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, sw13: torch.Tensor, sw2: torch.Tensor,
                    b13: torch.Tensor, b2: torch.Tensor, ep: int, tiles: list[int], activation: str,
                    glu: list[float], auto: bool) -> list[torch.Tensor]:
    """Gradients [dx, dweights, dw13, dw2, dsw13, dsw2, db13, db2] of ``region`` given dy [N, H]
    (zeros for the absent, width-0 ones)."""
    w, routing = _weights(x, ids, w13, w2, sw13, sw2, b13, b2, activation, glu), Routing(ids, weights)
    path = _path(w, x.shape[0], ep, tiles, auto, x.device)
    g = path.backward(path.forward(x, routing, w, True)[1], dy.to(x.dtype).contiguous())
    absent = (sw13, sw2, b13, b2)  # dshared_w13, dshared_w2, db13, db2: zeros of width 0 where None
    rest = zip(g.expert_tensors[2:], absent, strict=True)
    return [g.dx, g.dweights, g.dw13, g.dw2, *(torch.zeros_like(z) if t is None else t for t, z in rest)]


@region_backward.register_fake
def _(dy, x, ids, weights, w13, w2, sw13, sw2, b13, b2, ep, tiles, activation, glu, auto):
    return [torch.empty_like(t) for t in (x, weights, w13, w2, sw13, sw2, b13, b2)]


def _setup_context(ctx, inputs, output) -> None:
    x, ids, weights, w13, w2, sw13, sw2, b13, b2, ep, tiles, activation, glu, auto = inputs
    ctx.save_for_backward(x, ids, weights, w13, w2, sw13, sw2, b13, b2)
    ctx.config = (ep, tiles, activation, glu, auto)


def _backward(ctx, dy):
    dx, dweights, *experts = region_backward(dy, *ctx.saved_tensors, *ctx.config)
    return dx, None, dweights, *experts, None, None, None, None, None


region.register_autograd(_backward, setup_context=_setup_context)


def run_region(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertWeights, ep: int,
               tiles: TileSpec, auto: bool, nodes: int = 1) -> torch.Tensor:
    """The region through the custom op (tensors already padded to a multiple of ``ep``);
    ``auto``: the path AUTO decides, else the taskflow; ``nodes``: as ``RegionOptions.nodes``."""
    spec = w.spec
    none = w.w13.new_zeros(0, spec.hidden), w.w13.new_zeros(spec.hidden, 0)
    sw13, sw2 = (w.shared_w13, w.shared_w2) if w.has_shared else none
    b13, b2 = w.biases or (w.w13.new_zeros(spec.experts, 0), w.w13.new_zeros(spec.experts, 0))
    fields = _tile_fields(tiles, nodes)
    return region(x, ids, weights, w.w13, w.w2, sw13, sw2, b13, b2, ep, fields, spec.activation.value,
                  _glu_fields(spec.glu), auto)

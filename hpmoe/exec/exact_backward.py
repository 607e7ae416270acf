"""The exact backward executor: every EP rank of the backward task graph, virtual,
in one process, through ``hpmoe.exec.exact.run_graph`` with the backward region of the
tiles' ``RegionFamily``.

Every gradient tile is written by exactly one task holding its full reduction and
input gradients are summed over slots in a fixed order in fp32, so the result is
bitwise the same under every valid task order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..ir.graph import TaskGraph
from ..ir.verify import random_order
from ..regions.backward_kernels import (
    BACKWARD,
    BackwardBuffers,
    BackwardContext,
    SavedActivations,
    gradient_fields,
    gradient_shapes,
)
from ..regions.base import Kept, Region
from ..regions.dedup_backward_kernels import DedupBackwardBuffers
from ..regions.family import region_family
from ..regions.kernels import ForwardBuffers
from ..regions.slot_routing import SlotRouting
from ..regions.slots import SlotPlan
from ..routing import Routing, RoutingPlan
from ..spec import MoESpec, TileSpec
from ..weights import ExpertWeights, Rows, SlotGradients
from .exact import DEFAULT_TILES, Order, execute_forward, resolved_graph, run_graph


@dataclass
class Gradients:
    """Gradients of the MoE region with respect to its inputs and weights.

    dx: [N, H] spec.dtype; dweights: [N, k] float32 (routing weights); dw13: [E, 2F, H];
    dw2: [E, H, F]; dshared_w13: [2Fs, H] and dshared_w2: [H, Fs] (None without shared
    experts); db13 [E, 2F] and db2 [E, H] (None without expert biases), all spec.dtype.
    Under slot rows (``ExpertWeights.slot_rows``) the expert gradients are shaped like
    the stored tensors [R, ...], each row the sum of its slots' (``SlotGradients``).
    Shared gradients are summed over ranks in rank order in fp32."""

    dx: torch.Tensor
    dweights: torch.Tensor
    dw13: torch.Tensor
    dw2: torch.Tensor
    dshared_w13: torch.Tensor | None
    dshared_w2: torch.Tensor | None
    db13: torch.Tensor | None = None
    db2: torch.Tensor | None = None

    @property
    def expert_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """In the order of ``engine.RegionFunction``'s weight inputs: dw13, dw2, dshared_w13,
        dshared_w2, db13, db2."""
        return self.dw13, self.dw2, self.dshared_w13, self.dshared_w2, self.db13, self.db2


@dataclass
class BackwardResult:
    """grads: the gradients; buffers: each rank's backward buffers; graph: the
    backward task graph that ran."""

    grads: Gradients
    buffers: list[BackwardBuffers] | list[DedupBackwardBuffers]
    graph: TaskGraph


def execute_backward(saved: Sequence[SavedActivations], plan: RoutingPlan,
                     dy: torch.Tensor, weights: ExpertWeights, routing: Routing,
                     tiles: TileSpec = DEFAULT_TILES, recompute: Kept | bool = False,
                     order: Order = None) -> BackwardResult:
    """Lower and run the backward region of ``plan.par.ep`` virtual ranks (the region
    family of ``tiles``, as the forward ran).

    saved: per rank, what the forward kept (``region_family(tiles).saved`` of the same
    ``recompute``, a ``regions.Kept``); dy: [N, H] spec.dtype output gradient; routing:
    every rank's ids/weights [N, k].
    ``order``: task ids, an int seed for a random valid order, or None (task-id order)."""
    ep, family = plan.par.ep, region_family(tiles)
    _check_inputs(saved, plan, dy, weights)
    layout = family.layout(plan, tiles)
    slots = SlotGradients.of(weights, slice(None))
    out = _full_outputs(dy, weights, slots)
    views, dys = rank_views(out, plan, slots), dy.chunk(ep)
    buffers = [family.backward_buffers(saved[r], dys[r], layout, tiles, r, views[r]) for r in range(ep)]
    contexts = [family.backward_context(weights, layout, family.rank_routing(routing, plan, r), r)
                for r in range(ep)]
    region = family.backward(layout, recompute)
    return _run(region, plan, tiles, order, buffers, contexts, out, weights, slots)


def _check_inputs(saved: Sequence, plan: RoutingPlan, dy: torch.Tensor, weights: ExpertWeights) -> None:
    ep = plan.par.ep
    if len(saved) != ep:
        raise ValueError(f"saved has {len(saved)} ranks, expected ep={ep}")
    _check_dy(dy, weights, plan.par.tokens_per_rank * ep)


def _run(region: Region, plan: RoutingPlan, tiles: TileSpec, order: Order, buffers: list, contexts: list,
         out: Gradients, weights: ExpertWeights, slots: SlotGradients) -> BackwardResult:
    """Lower ``region``, run it in ``order`` over the ranks' buffers, and complete ``out``
    (whose expert rows the ranks wrote) with the replicas' scratch rows (``slots``) and
    the shared experts' rank sums."""
    graph = region.graph(plan, tiles)
    if isinstance(order, int):
        order = random_order(graph, order)
    run_graph(graph, region, buffers, contexts, order)
    slots.fold()
    grads = replace(out, dshared_w13=_rank_sum(buffers, "dsw13", weights),
                    dshared_w2=_rank_sum(buffers, "dsw2", weights))
    return BackwardResult(grads=grads, buffers=buffers, graph=graph)


def _full_outputs(dy: torch.Tensor, weights: ExpertWeights, slots: SlotGradients) -> Gradients:
    """Full-size gradients every rank writes its part of (no copies afterwards); expert
    gradients ``slots``' zero-filled ones (experts without rows get no task)."""
    k = weights.spec.top_k
    return full_expert_gradients(slots, torch.empty(dy.shape, dtype=dy.dtype, device=dy.device),
                                 torch.empty(dy.shape[0], k, device=dy.device))


def full_expert_gradients(slots: SlotGradients, dx: torch.Tensor, dweights: torch.Tensor) -> Gradients:
    """``Gradients`` whose expert gradients (biases' included) are ``slots``' full ones and
    no shared-expert ones yet: ranks write their experts' rows (``SlotGradients.views``)."""
    f = slots.full
    return Gradients(dx=dx, dweights=dweights, dw13=f["dw13"], dw2=f["dw2"], dshared_w13=None,
                     dshared_w2=None, db13=f.get("db13"), db2=f.get("db2"))


def rank_views(out: Gradients, plan: RoutingPlan,
               slots: SlotGradients) -> list[dict[str, torch.Tensor | Rows]]:
    """Per rank, its slices of full-size ``dx``/``dweights`` (its tokens) and where its
    experts' gradients land (``SlotGradients.views``), keyed by ``BackwardBuffers`` field."""
    ep, local = plan.par.ep, plan.local_experts
    dx, dw = out.dx.chunk(ep), out.dweights.chunk(ep)
    return [{"dx": dx[r], "dw": dw[r], **slots.views(slice(r * local, (r + 1) * local))} for r in range(ep)]


def _check_dy(dy: object, weights: ExpertWeights, tokens: int) -> None:
    spec = weights.spec
    if not isinstance(dy, torch.Tensor):
        raise TypeError(f"dy must be a torch.Tensor, got {type(dy).__name__}")
    if tuple(dy.shape) != (tokens, spec.hidden):
        raise ValueError(f"dy has shape {tuple(dy.shape)}, expected {(tokens, spec.hidden)}")
    if dy.dtype != spec.dtype:
        raise TypeError(f"dy has dtype {dy.dtype}, expected {spec.dtype} (MoESpec.dtype)")


def _rank_sum(buffers: Sequence[BackwardBuffers], name: str, weights: ExpertWeights) -> torch.Tensor | None:
    """Sum of a shared-expert gradient over ranks, in rank order, in fp32."""
    if not weights.has_shared:
        return None
    first = getattr(buffers[0], name)
    acc = torch.zeros(first.shape, device=first.device)
    for b in buffers:
        acc += getattr(b, name).float()
    return acc.to(weights.spec.dtype)


@dataclass
class StepResult:
    """out: [N, H] spec.dtype forward output; backward: the backward run."""

    out: torch.Tensor
    backward: BackwardResult


def moe_forward_backward(x: torch.Tensor, weights: ExpertWeights, routing: Routing, dy: torch.Tensor,
                         ep: int = 1, tiles: TileSpec = DEFAULT_TILES, recompute: Kept | bool = False,
                         forward_order: Order = None, backward_order: Order = None,
                         nodes: int = 1) -> StepResult:
    """Forward then backward of the MoE region over ``ep`` virtual ranks on ``nodes``
    nodes (which only ``DispatchMode.PER_NODE`` tiles relay between).

    x, dy: [N, H] spec.dtype; routing: ids/weights [N, k]; recompute: what the backward
    finds kept (``regions.Kept``; a bool: whether the shared activation is recomputed)."""
    fwd = execute_forward(x, weights, routing, ep, tiles, forward_order, nodes)
    saved = [region_family(tiles).saved(b, recompute) for b in fwd.buffers]
    bwd = execute_backward(saved, fwd.plan, dy, weights, routing, tiles, recompute, backward_order)
    return StepResult(out=fwd.out, backward=bwd)


@dataclass(frozen=True)
class PreparedSlotBackward:
    """The per-shape backward region of one call (``prepare_slot_backward``), ready to
    run (once): its graph resolved for the call's routing, one rank's buffers and
    context, the full-size gradients they write and the expert gradients' replicas."""

    graph: TaskGraph
    buffers: list[BackwardBuffers]
    contexts: list[BackwardContext]
    out: Gradients
    weights: ExpertWeights
    experts: SlotGradients

    def run(self, order: Sequence[int] | None = None, graph: TaskGraph | None = None) -> Gradients:
        """Run every task once in ``order`` under ``graph``'s waits (default: its own)."""
        run_graph(self.graph if graph is None else graph, BACKWARD, self.buffers, self.contexts, order)
        self.experts.fold()
        return replace(self.out, dshared_w13=_rank_sum(self.buffers, "dsw13", self.weights),
                       dshared_w2=_rank_sum(self.buffers, "dsw2", self.weights))


def prepare_slot_backward(plan: SlotPlan, forward: ForwardBuffers, slots: SlotRouting, dy: torch.Tensor,
                          weights: ExpertWeights, routing: Routing) -> PreparedSlotBackward:
    """The per-shape backward ``plan`` after a per-shape forward whose buffers are
    ``forward`` and whose routing resolved to ``slots`` (``exact.prepare_slot_forward``):
    dy [T, H] spec.dtype.  Experts with biases are not planned per shape (ValueError)."""
    spec, shape = weights.spec, plan.shape
    if spec.expert_bias:
        raise ValueError("a per-shape backward has no expert-bias gradients (MoESpec.expert_bias)")
    _check_dy(dy, weights, shape.tokens)
    grads = SlotGradients.of(weights, slice(None))
    out = _full_outputs(dy, weights, grads)
    saved = SavedActivations.from_forward(forward, recompute=False)
    buffers = slot_backward_buffers(saved, dy, spec, shape.capacity,
                                    {"dx": out.dx, "dw": out.dweights, **grads.views(slice(0, spec.experts))})
    row_weight = torch.zeros(shape.capacity, dtype=torch.float32, device=dy.device)
    row_weight[slots.pos.reshape(-1)] = routing.weights.reshape(-1).float()
    mine = weights.local(slice(0, spec.experts))
    ctx = BackwardContext(w13=mine.w13, w2=mine.w2, shared_w13=weights.shared_w13,
                          shared_w2=weights.shared_w2,
                          token_of_row=slots.row_token, row_weight=row_weight, pos=slots.pos,
                          activation=spec.activation, glu=spec.glu)
    return PreparedSlotBackward(graph=resolved_graph(plan, slots), buffers=[buffers], contexts=[ctx], out=out,
                                weights=weights, experts=grads)


def slot_backward_buffers(saved: SavedActivations, dy: torch.Tensor, spec: MoESpec, capacity: int,
                          views: dict) -> BackwardBuffers:
    """One rank's backward buffers whose permuted buffers hold the ``capacity`` rows of a
    slot layout; ``views``: dx, dw and the expert gradients' rows (uninitialised, but the
    shared weights' gradients zero)."""
    shapes = gradient_shapes(spec, spec.experts, dy.shape[0], capacity, sent=capacity)
    full, bufs = gradient_fields(shapes, saved, dy, views)
    return BackwardBuffers(saved=full, dy=dy, **bufs)

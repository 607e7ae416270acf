"""The backward region on the runtime: the gradient of what ``ForwardRunner`` ran, the
backward region of the tiles' ``RegionFamily`` (per expert, or deduplicated), optionally
recomputing the gated activations.

Per call, on every rank of the session's group (plan of ``run_backward``):
  1. snapshot the counters, then agree on the region (a collective: no peer puts
     before every rank has snapshotted; in forward the count exchange does this);
  2. lower every rank's graph from the forward's plan, schedule it, keep this rank's part;
  3. size symmetric memory and post receives (``Transport.prepare``);
  4. run the rank's workers.
Nothing is exchanged: the plan and, deduplicated, every rank's routing come from the
forward (``ForwardOutput.plan`` and ``.routing``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..exec.exact_backward import Gradients, full_expert_gradients
from ..exec.program import RankProgram, compile_program, compile_region
from ..ir.schedule import Schedule
from ..regions.backward_kernels import BackwardBuffers, SavedActivations
from ..regions.base import Kept, Region
from ..regions.dedup_backward_kernels import DedupBackwardBuffers
from ..regions.family import region_family
from ..routing import Routing, RoutingPlan
from ..weights import ExpertWeights, SlotGradients
from .forward import ForwardOptions
from .session import Session
from .transport.base import Step


@dataclass
class BackwardOutput:
    """grads: dx [T, H] spec.dtype and dweights [T, k] float32 of this rank's tokens;
    dw13 [E, 2F, H] and dw2 [E, H, F] full size (shaped like the stored tensors under
    slot rows), this rank's experts' rows filled in and zeros elsewhere;
    dshared_w13/dshared_w2 this rank's share (None without shared experts).
    buffers: the rank's buffers (symmetric fields valid until the next region);
    schedule: every rank's schedule; program: this rank's part."""

    grads: Gradients
    buffers: BackwardBuffers | DedupBackwardBuffers
    schedule: Schedule
    program: RankProgram


def run_backward(s: Session, plan: RoutingPlan, saved: SavedActivations, dy: torch.Tensor,
                 weights: ExpertWeights, routing: Routing, options: ForwardOptions,
                 recompute: Kept | bool = False, agreed: bool = False) -> BackwardOutput:
    """This rank's part of the backward of the forward that ran ``plan`` with ``options``.

    saved: what that forward kept (``region_family(options.tiles).saved`` of the same
    ``recompute``, a ``regions.Kept``; symmetric fields copied);
    dy: [T, H] spec.dtype; routing: the forward's ``ForwardOutput.routing`` (this rank's
    [T, k], or every rank's [ep*T, k] when deduplicated); agreed: the caller's call
    agreement opened the region (``Session.open_call``: counters snapshotted, ranks in
    step)."""
    tiles, family = options.tiles, region_family(options.tiles)
    layout = family.layout(plan, tiles)
    region = family.backward(layout, recompute)
    program, schedule = _open(s, plan, region, options, weights, agreed)
    sym = s.transport.prepare(Step(region, plan, tiles, schedule, program))
    mine = slice(s.rank * plan.local_experts, (s.rank + 1) * plan.local_experts)
    shared = weights.has_shared
    slots = SlotGradients.of(weights, mine, fill=None)  # every WGRAD task writes its rows whole
    grads = full_expert_gradients(slots, dx=dy, dweights=dy)  # dx, dweights: the buffers', below
    buf = family.backward_buffers(saved, dy, layout, tiles, s.rank, {**sym, **slots.views(mine)})
    ctx = family.backward_context(weights, layout, routing, s.rank)
    s.executor.run(program, region, buf, ctx, s.transport)
    slots.zero_idle((plan.counts[:, s.rank].sum(dim=0) > 0).tolist())  # experts without rows: no task
    slots.fold()
    grads = replace(grads, dx=buf.dx, dweights=buf.dw, dshared_w13=buf.dsw13 if shared else None,
                    dshared_w2=buf.dsw2 if shared else None)
    return BackwardOutput(grads=grads, buffers=buf, schedule=schedule, program=program)


def _open(s: Session, plan: RoutingPlan, region: Region, options: ForwardOptions,
          weights: ExpertWeights, agreed: bool) -> tuple[RankProgram, Schedule]:
    """Open ``region`` on ``s`` (snapshot, then the agreement, unless the caller's has);
    lower every rank, schedule, keep this rank's program."""
    if agreed:
        s.regions += 1
    else:
        s.transport.begin()
        s.agree(region.kind, weights, plan.par.tokens_per_rank, options.tiles)
    schedule = compile_region(plan, region, options.tiles, options.policy, options.hardware)
    return compile_program(schedule, region, s.rank), schedule

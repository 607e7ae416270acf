"""The region families: everything that depends on what one dispatch row is.

A row per (token, expert) (``DispatchMode.PER_EXPERT``) or per (token, destination rank)
with receivers that expand and partially reduce (``PER_RANK``, ``PER_NODE``: the
deduplicated regions) changes the lowering, the kernels, the buffers, the per-rank
contexts and what the forward saves for the backward — and nothing else.  A
``RegionFamily`` owns those; ``region_family(tiles)`` is the one place that asks which
dispatch mode the tiles name.  Every executor (exact, runtime) and the layer go through it.

``layout``: what the family lowers from — the plan itself (per expert) or the
``DedupLayout`` of the plan and tiles (built once and read by lowering, buffers and
contexts).  Contexts read the routing the family says (``reads_every_rank``): a rank's
own tokens' (per expert) or every rank's (deduplicated: receivers weigh rows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..routing import Routing, RoutingPlan
from ..spec import DispatchMode, TileSpec
from ..weights import ExpertWeights
from .backward_kernels import BACKWARDS, BackwardBuffers, BackwardContext, SavedActivations
from .base import Kept, Region, RegionKind, as_kept
from .dedup_backward_kernels import (
    DedupBackwardBuffers,
    DedupBackwardContext,
    dedup_backward_region,
)
from .dedup_kernels import DedupBuffers, DedupContext, dedup_region
from .dedup_layout import make_dedup_layout
from .kernels import FORWARD, ForwardBuffers, RankContext


@dataclass(frozen=True)
class RegionFamily:
    """One dispatch layout's region: ``forward_kind`` (what the agreement names),
    ``reads_every_rank`` (its contexts read every rank's routing), and what builds the rest
    (both families keep ``SavedActivations``):

    - ``layout(plan, tiles)``: what it lowers from, built once and read by the rest;
    - ``forward(layout)``, ``backward(layout, recompute)``: its regions (the backward's
      of what the forward kept, ``base.as_kept``);
    - ``forward_buffers(x, layout, tiles, rank, symmetric=None)``: the buffers of ``rank``
      holding its tokens ``x`` (``symmetric``: its symmetric fields as views of a
      symmetric heap; None: allocated here); ``forward_context(weights, layout, routing,
      rank)``;
    - ``saved(buffers, recompute, symmetric=False)``: what the forward keeps
      (``symmetric``: the buffers view memory the next region reuses, so the saved fields
      that live there are copied);
    - ``backward_buffers(saved, dy, layout, tiles, rank, views=None)``,
      ``backward_context(weights, layout, routing, rank)``."""

    forward_kind: RegionKind
    reads_every_rank: bool
    layout: Callable[[RoutingPlan, TileSpec], Any]
    forward: Callable[[Any], Region]
    backward: Callable[[Any, Kept | bool], Region]
    forward_buffers: Callable[..., Any]
    forward_context: Callable[[ExpertWeights, Any, Routing, int], Any]
    saved: Callable[..., Any]
    backward_buffers: Callable[..., Any]
    backward_context: Callable[[ExpertWeights, Any, Routing, int], Any]

    def __reduce__(self) -> tuple:  # pickled by name: the two families are module constants
        return _named, (self.forward_kind,)

    def rank_routing(self, routing: Routing, plan: RoutingPlan, rank: int) -> Routing:
        """What ``rank``'s contexts read, from every rank's routing."""
        if self.reads_every_rank:
            return routing
        tpr = plan.par.tokens_per_rank
        mine = slice(rank * tpr, (rank + 1) * tpr)
        return Routing(routing.ids[mine], routing.weights[mine])


def _forward_buffers(x: torch.Tensor, plan: RoutingPlan, tiles: TileSpec, rank: int,
                     symmetric: Mapping[str, torch.Tensor] | None = None) -> ForwardBuffers:
    sym = symmetric or {}
    return ForwardBuffers.allocate(x, plan, rank, recv=sym.get("recv"), comb=sym.get("comb"))


def _saved(buffers: ForwardBuffers, recompute: Kept | bool, symmetric: bool = False) -> SavedActivations:
    saved = SavedActivations.from_forward(buffers, recompute)
    if symmetric and saved.xe is not None:  # recv views the session's symmetric memory
        saved = replace(saved, xe=saved.xe.clone())
    return saved


PER_EXPERT = RegionFamily(
    RegionKind.FORWARD, reads_every_rank=False,
    layout=lambda plan, tiles: plan,
    forward=lambda plan: FORWARD,
    backward=lambda plan, recompute: BACKWARDS[as_kept(recompute)],
    forward_buffers=_forward_buffers,
    forward_context=lambda weights, plan, routing, rank: RankContext.of(weights, plan, routing.weights, rank),
    saved=_saved,
    backward_buffers=lambda saved, dy, plan, tiles, rank, views=None: BackwardBuffers.allocate(
        saved, dy, plan, views),
    backward_context=lambda weights, plan, routing, rank: BackwardContext.build(
        weights, plan, routing.weights, rank))
DEDUPLICATED = RegionFamily(
    RegionKind.FORWARD_DEDUP, reads_every_rank=True,
    layout=make_dedup_layout,
    forward=dedup_region,
    backward=dedup_backward_region,
    forward_buffers=DedupBuffers.allocate,
    forward_context=DedupContext.build,
    saved=lambda buffers, recompute, symmetric=False: SavedActivations.from_forward(  # none of its
        buffers, recompute),  # saved fields is symmetric
    backward_buffers=DedupBackwardBuffers.allocate,
    backward_context=DedupBackwardContext.build)


def _named(kind: RegionKind) -> RegionFamily:
    return PER_EXPERT if kind is RegionKind.FORWARD else DEDUPLICATED


def region_family(tiles: TileSpec) -> RegionFamily:
    """The family of ``tiles.dispatch``: per expert, or deduplicated (per rank, per node)."""
    return PER_EXPERT if tiles.dispatch is DispatchMode.PER_EXPERT else DEDUPLICATED

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

import abc
from collections.abc import Mapping
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
class RegionFamily(abc.ABC):
    """One dispatch layout's region: ``forward_kind`` (what the agreement names) and
    ``reads_every_rank`` (its contexts read every rank's routing); the methods below build
    everything else (both keep ``SavedActivations``)."""

    forward_kind: RegionKind
    reads_every_rank: bool

    @abc.abstractmethod
    def layout(self, plan: RoutingPlan, tiles: TileSpec) -> Any:
        raise NotImplementedError

    @abc.abstractmethod
    def forward(self, layout: Any) -> Region:
        raise NotImplementedError

    @abc.abstractmethod
    def backward(self, layout: Any, recompute: Kept | bool) -> Region:
        """The backward region of what the forward kept (``base.as_kept``)."""
        raise NotImplementedError

    @abc.abstractmethod
    def forward_buffers(self, x: torch.Tensor, layout: Any, tiles: TileSpec, rank: int,
                        symmetric: Mapping[str, torch.Tensor] | None = None) -> Any:
        """Buffers of ``rank`` holding its tokens ``x``; ``symmetric``: its symmetric fields
        as views of a symmetric heap (None: allocated here)."""
        raise NotImplementedError

    @abc.abstractmethod
    def forward_context(self, weights: ExpertWeights, layout: Any, routing: Routing, rank: int) -> Any:
        raise NotImplementedError

    @abc.abstractmethod
    def saved(self, buffers: Any, recompute: Kept | bool, symmetric: bool = False) -> Any:
        """What the forward keeps (``base.as_kept``);
        ``symmetric``: the buffers view symmetric memory the next region reuses, so the
        saved fields that live there are copied."""
        raise NotImplementedError

    @abc.abstractmethod
    def backward_buffers(self, saved: Any, dy: torch.Tensor, layout: Any, tiles: TileSpec, rank: int,
                         views: Mapping[str, torch.Tensor] | None = None) -> Any:
        raise NotImplementedError

    @abc.abstractmethod
    def backward_context(self, weights: ExpertWeights, layout: Any, routing: Routing, rank: int) -> Any:
        raise NotImplementedError

    def rank_routing(self, routing: Routing, plan: RoutingPlan, rank: int) -> Routing:
        """What ``rank``'s contexts read, from every rank's routing."""
        if self.reads_every_rank:
            return routing
        tpr = plan.par.tokens_per_rank
        mine = slice(rank * tpr, (rank + 1) * tpr)
        return Routing(routing.ids[mine], routing.weights[mine])


class _PerExpert(RegionFamily):
    def layout(self, plan: RoutingPlan, tiles: TileSpec) -> RoutingPlan:
        return plan

    def forward(self, layout: RoutingPlan) -> Region:
        return FORWARD

    def backward(self, layout: RoutingPlan, recompute: Kept | bool) -> Region:
        return BACKWARDS[as_kept(recompute)]

    def forward_buffers(self, x, layout, tiles, rank, symmetric=None):
        sym = symmetric or {}
        return ForwardBuffers.allocate(x, layout, rank, recv=sym.get("recv"), comb=sym.get("comb"))

    def forward_context(self, weights, layout, routing, rank):
        return RankContext.of(weights, layout, routing.weights, rank)

    def saved(self, buffers, recompute, symmetric=False):
        saved = SavedActivations.from_forward(buffers, recompute)
        if symmetric and saved.xe is not None:  # recv views the session's symmetric memory
            saved = replace(saved, xe=saved.xe.clone())
        return saved

    def backward_buffers(self, saved, dy, layout, tiles, rank, views=None):
        return BackwardBuffers.allocate(saved, dy, layout, views)

    def backward_context(self, weights, layout, routing, rank):
        return BackwardContext.build(weights, layout, routing.weights, rank)


class _Deduplicated(RegionFamily):
    def layout(self, plan, tiles):
        return make_dedup_layout(plan, tiles)

    def forward(self, layout):
        return dedup_region(layout)

    def backward(self, layout, recompute):
        return dedup_backward_region(layout, recompute)

    def forward_buffers(self, x, layout, tiles, rank, symmetric=None):
        return DedupBuffers.allocate(x, layout, tiles, rank, symmetric)

    def forward_context(self, weights, layout, routing, rank):
        return DedupContext.build(weights, layout, routing, rank)

    def saved(self, buffers, recompute, symmetric=False):
        return SavedActivations.from_forward(buffers, recompute)  # none of its saved fields is symmetric

    def backward_buffers(self, saved, dy, layout, tiles, rank, views=None):
        return DedupBackwardBuffers.allocate(saved, dy, layout, tiles, rank, views)

    def backward_context(self, weights, layout, routing, rank):
        return DedupBackwardContext.build(weights, layout, routing, rank)


PER_EXPERT = _PerExpert(RegionKind.FORWARD, reads_every_rank=False)
DEDUPLICATED = _Deduplicated(RegionKind.FORWARD_DEDUP, reads_every_rank=True)


def region_family(tiles: TileSpec) -> RegionFamily:
    """The family of ``tiles.dispatch``: per expert, or deduplicated (per rank, per node)."""
    return PER_EXPERT if tiles.dispatch is DispatchMode.PER_EXPERT else DEDUPLICATED

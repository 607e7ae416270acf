"""Where a layer's experts live and how loaded they are: its placement (which physical
slot holds which expert, ``hpmoe.placement``), the measured per-expert load, the
rebalance that plans a new placement from it, and the move that adopts one.

A layer that stores every expert (the default) adopts a placement by reading slots in
place (``Placement.slot_weights``); one with ``shard_experts`` stores only its own
slots' rows and moves them between ranks with their optimizer state (``migration``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from ..migration import Migration, Moves, migrate, move_seconds, replica_seconds, replica_sum
from ..placement import Placement, plan_placement, rank_loads
from ..routing import Routing
from ..spec import MoESpec
from ..weights import ExpertWeights
from .options import RegionOptions
from .paths import RegionClock

if TYPE_CHECKING:
    from ..runtime import Session

LOAD_DECAY = 0.9  # of the measured per-expert load, per call
FOLD = 64  # a CPU's calls whose rows per expert are folded into the load at once
MIN_REBALANCE_GAIN = 1.05  # a new placement must lower the busiest rank's predicted load this much


def own_rows(spec: MoESpec, options: RegionOptions, placement: Placement | None = None) -> slice:
    """The slots of this rank of ``options``' ep_group under ``placement`` (None: one
    expert per slot)."""
    per = (placement.slots if placement is not None else spec.experts) // options.ranks
    rank = dist.get_rank(options.group)
    return slice(rank * per, (rank + 1) * per)


class Balance:
    """The placement and load of one layer of ``spec`` run with ``options``; ``session``
    gives the layer's runtime session (None in one process)."""

    def __init__(self, spec: MoESpec, options: RegionOptions, session: Callable[[], Session | None],
                 placement: Placement | None = None):
        self.spec, self.options, self._session = spec, options, session
        self._load = torch.zeros(spec.experts, dtype=torch.float64, device="cpu")  # moves to the routing's
        self._pending: list[torch.Tensor] = []  # a CPU's rows per call, not folded in yet
        self.calls = 0
        self.clock = RegionClock() if options.shard_experts else None  # what a move would save
        self._placement = self.checked(placement)

    @property
    def placement(self) -> Placement | None:
        return self._placement

    def set(self, placement: Placement | None) -> None:
        """Adopt ``placement`` on a layer that stores every expert (nothing moves)."""
        if self.options.shard_experts:
            raise ValueError("a layer with shard_experts stores its own slots only: a new placement moves "
                             "rows between ranks, use layer.move_to(placement, optimizer)")
        self._placement = self.checked(placement)

    def checked(self, placement: Placement | None) -> Placement | None:
        """``placement`` for this layer (None for the identity), else raises naming it."""
        o, ranks = self.options, self.options.ranks
        if placement is None:
            return None
        if not isinstance(placement, Placement):
            raise TypeError(f"placement must be a Placement, got {type(placement).__name__}")
        if (placement.experts, placement.ranks, placement.nodes) != (self.spec.experts, ranks, o.nodes):
            raise ValueError(f"placement is for {placement.experts} experts on {placement.ranks} ranks, "
                             f"{placement.nodes} nodes; the layer has {self.spec.experts} experts on "
                             f"{ranks} ranks, {o.nodes} nodes")
        return None if placement.is_identity else placement

    def physical(self) -> Placement:
        """The placement in effect, the identity included."""
        o = self.options
        return self._placement or Placement.identity(self.spec.experts, o.ranks, o.nodes)

    @property
    def sharded(self) -> bool:
        """Whether calls run on the physical layer (one expert per slot)."""
        return self._placement is not None or self.options.shard_experts

    def own_slots(self) -> slice | None:
        """This rank's slots on an EP group, the only ones a path reads; None in one
        process, or where every agreement checksums the weights (every slot filled)."""
        s = self._session()
        if s is None or s.config.check_weights or not self.sharded:
            return None
        return own_rows(self.spec, self.options, self._placement)

    def region_spec(self, spec: MoESpec) -> MoESpec:
        """The layer a call computes (``spec`` in the compute dtype): one expert per
        physical slot under a placement."""
        return self.physical().physical_spec(spec) if self.sharded else spec

    def place(self, routing: Routing, w: ExpertWeights, padded: int,
              tokens: list[int] | None) -> tuple[Routing, ExpertWeights]:
        """The call on the physical layer: each (token, slot) row's physical slot
        (``Placement.physical_ids`` of the token's rank and index: ``tokens``, every EP
        rank's count, else ``padded`` tokens over the virtual ranks) and weights whose
        slots read their expert's rows in place."""
        p = self._placement
        if p is None:
            return routing, w
        index = torch.arange(routing.ids.shape[0], device=routing.ids.device)
        if tokens is None:
            token_rank, first = index // (padded // self.options.virtual_ep), 0
        else:
            rank = dist.get_rank(self.options.group)
            token_rank, first = torch.full_like(index, rank), sum(tokens[:rank])
        ids = p.physical_ids(routing.ids, token_rank, first + index)
        return Routing(ids, routing.weights), w if self.options.shard_experts else p.slot_weights(w)

    def stored_slots(self, spec: MoESpec, tensors: list[torch.Tensor], shared_w13: torch.Tensor | None,
                     shared_w2: torch.Tensor | None,
                     shared_parts: tuple[torch.Tensor, torch.Tensor] | None = None) -> ExpertWeights:
        """A sharded layer's region weights (``tensors``: its stored w13, w2 and biases):
        the physical layer whose slots on this rank read its stored rows (the others -1);
        an expert replicated on several ranks sums its rows' gradients over them
        (``migration.replica_sum``)."""
        p, mine = self.physical(), own_rows(self.spec, self.options, self._placement)
        rows = tuple(s - mine.start if mine.start <= s < mine.stop else -1 for s in range(p.slots))
        if p.spread:  # spares (a second slot on one rank) take no tokens and are never read
            tensors = replica_sum(tensors, p.phy2log[mine], p.spread, self._session().collectives)
        return ExpertWeights.routed(p.physical_spec(spec), tensors[0], tensors[1], shared_w13, shared_w2,
                                    *tensors[2:], slot_rows=rows, shared_parts=shared_parts)

    @property
    def load(self) -> torch.Tensor:
        """[E] float64: the rows routed to each expert, a moving average over calls
        (``LOAD_DECAY`` per call)."""
        if self._pending:
            self._fold()
        return self._load

    @load.setter
    def load(self, value: torch.Tensor) -> None:
        self._pending.clear()
        self._load = value

    def measure(self, rows: torch.Tensor) -> None:
        """Fold a call's rows per expert ([E], any integer dtype, not written after) into
        the load's moving average, and run the periodic rebalance (``rebalance_every``;
        eager training calls only).  A device's in place (no host read; a CUDA graph's
        replays update it too); a CPU's kept and folded ``FOLD`` calls at a time (two
        tensor operations a call are a small call's largest host cost after its check)."""
        if rows.is_cpu and self._load.is_cpu:
            self._pending.append(rows)
            if len(self._pending) == FOLD:
                self._fold()
        else:
            if self._load.device != rows.device:
                self._load = self.load.to(rows.device)
            self._load.mul_(LOAD_DECAY).add_(rows, alpha=1.0 - LOAD_DECAY)
        self.calls += 1
        every = self.options.rebalance_every
        if every and self.calls % every == 0 and torch.is_grad_enabled():
            self.rebalance(self.options.redundant, [])

    def _fold(self) -> None:
        """The kept calls' rows into the load: n calls decay it by ``LOAD_DECAY**n`` and
        add each call's rows decayed by the calls after it."""
        rows = torch.stack(self._pending).to(torch.float64)
        n = rows.shape[0]
        after = torch.arange(n - 1, -1, -1, dtype=torch.float64, device=rows.device)
        self._load.mul_(LOAD_DECAY ** n).add_((LOAD_DECAY ** after) @ rows, alpha=1.0 - LOAD_DECAY)
        self._pending.clear()

    def expert_load(self) -> np.ndarray:
        """[E] this rank's measured routed rows per expert."""
        return self.load.cpu().numpy().copy()

    def move_to(self, placement: Placement | None, stored: list[torch.Tensor],
                optimizer: torch.optim.Optimizer | None = None) -> Migration:
        """Adopt ``placement``: a sharded layer moves its ``stored`` rows (and their
        gradients and ``optimizer``'s state) between ranks (collective); any other moves
        nothing."""
        new = self.checked(placement)
        o = self.options
        if not o.shard_experts:
            self._placement = new
            return Migration.nothing()
        slots = placement.slots if placement is not None else self.spec.experts
        if slots != self.physical().slots:
            raise ValueError(f"a layer with shard_experts stores {self.physical().slots} slots (experts plus "
                             f"redundant={o.redundant}): the placement has {slots}")
        moves = Moves.between(self.physical(), new or Placement.identity(self.spec.experts, o.ranks, o.nodes))
        moved = migrate(stored, moves, optimizer, self._session().collectives, o.rank_hardware)
        self._placement = new  # a failed move (``MoveError``) keeps the old placement and its rows
        return moved

    def rebalance(self, redundant: int, stored: list[torch.Tensor], min_gain: float = MIN_REBALANCE_GAIN,
                  optimizer: torch.optim.Optimizer | None = None, steps: int = 0) -> Placement | None:
        """``MoE.rebalance`` (collective over the ep_group); ``stored``: a sharded layer's
        stored expert tensors."""
        o = self.options
        if o.shard_experts and redundant != o.redundant:
            raise ValueError(f"rebalance(redundant={redundant}) on a layer with shard_experts, which stores "
                             f"redundant={o.redundant} extra slots: pass that")
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"rebalance(steps={steps!r}) must be an int >= 0")
        clock = self.clock.call_s if self.clock is not None else 0.0
        mine = torch.cat([self.load.cpu(), torch.tensor([clock], dtype=torch.float64, device="cpu")])
        if o.distributed:  # every rank's load summed, the slowest rank's call
            every = self._session().collectives.all_gather(mine, "rebalance: expert load")
            mine = torch.cat([every[:, :-1].sum(0), every[:, -1].max().view(1)])
        load, call_s = mine[:-1].numpy(), float(mine[-1])
        plan, now, then, timed = self._plan(load, redundant, call_s, stored)
        saving = steps * (now - then) if timed else 0.0
        if now >= min_gain * then > 0 and (not steps or self._worth_moving(plan, stored, optimizer, saving)):
            self.move_to(plan, stored, optimizer)
        return self._placement

    def _plan(self, load: np.ndarray, redundant: int, call_s: float,
              stored: list[torch.Tensor]) -> tuple[Placement, float, float, bool]:
        """(the plan, the cost of a call now, its predicted cost under the plan, whether
        the costs are seconds).  The busiest rank's load under each placement; for a layer
        with ``shard_experts`` whose calls were measured, seconds of a call instead (the
        measured ``call_s`` scaled by the busiest rank's load, plus ``replica_seconds``),
        the plan the best over every number of the ``redundant`` slots spread as replicas
        (the rest spares): a replica's gradient all-reduce can cost more than the
        imbalance it removes."""
        o, current = self.options, self.physical()
        busiest = rank_loads(current, load).max()
        if not (o.shard_experts and call_s > 0 and busiest > 0):
            plan = plan_placement(load, o.ranks, redundant, o.nodes, current)
            return plan, float(busiest), float(rank_loads(plan, load).max()), False
        hw = o.rank_hardware

        def seconds(p: Placement) -> float:
            return call_s * rank_loads(p, load).max() / busiest + replica_seconds(stored, p, hw)

        plans = [plan_placement(load, o.ranks, redundant, o.nodes, current, spread=r)
                 for r in range(redundant + 1)]
        plan = min(plans, key=seconds)
        return plan, seconds(current), seconds(plan), True

    def _worth_moving(self, plan: Placement, stored: list[torch.Tensor],
                      optimizer: torch.optim.Optimizer | None, saving_s: float) -> bool:
        """Whether moving to ``plan`` takes less than ``saving_s``, the seconds the calls
        it serves are predicted to save (``_plan``), against the move's modelled time
        (``Moves.seconds`` on the layer's hardware model); a layer that does not shard its
        experts moves nothing."""
        if not self.options.shard_experts:
            return True
        moves, hw = Moves.between(self.physical(), plan), self.options.rank_hardware
        return move_seconds(stored, optimizer, moves, hw) < saving_s

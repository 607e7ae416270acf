"""Expert placement as data: which logical expert each physical slot holds, which
replica each token uses, and the planner that replicates hot experts and packs the
slots onto ranks (DeepSeek's EPLB: greedy replication of the expert with the highest
load per replica, then balanced packing; hierarchical over nodes).

A ``Placement`` turns a logical layer into a physical one that every stage reads
unchanged: ``physical_spec`` (``experts`` = slots), ``physical_ids`` (each (token,
expert) pair mapped to one replica) and ``slot_weights`` (each slot reads its logical
expert's weights in place, and a path's gradients of a slot land on its logical
expert's rows, replicas summed: every path reads them so, kernel by kernel, the
taskflows and the persistent kernel; ``weights.SlotGradients``), or
``physical_weights`` (the same gathered differentiably, so autograd sums the replicas'
gradients into the logical expert's: a physical layer built once; ``ExpertWeights.gathered``
fills one rank's slots alone).  Rank ``r`` holds slots ``[r * S, (r + 1) * S)``, as it holds experts without a
placement.  The identity placement is today's layout.

A token's replica: one on the token's own rank if there is one; else one on its node
(``nodes`` > 1); else replica ``(token + slot) mod count`` of its expert's replicas — a
fixed function of the token's global index, so the result never depends on timing.  A
second slot of an expert on one rank is a spare: it takes no tokens (``used``).
Every replica computes the same bits as its logical expert's row would (a row's GEMM
does not depend on which rows share its tile; tests/test_placement.py checks the output
and every gradient against the identity placement).
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, replace

import numpy as np
import torch

from .routing import Routing
from .spec import MoESpec, ParallelSpec
from .weights import ExpertWeights


@dataclass(frozen=True)
class Placement:
    """``phy2log[s]``: the logical expert physical slot ``s`` holds; ``ranks`` ranks of
    ``len(phy2log) // ranks`` slots each, ``nodes`` nodes of ``ranks // nodes`` ranks."""

    phy2log: tuple[int, ...]
    experts: int
    ranks: int
    nodes: int = 1

    def __post_init__(self) -> None:
        p = len(self.phy2log)
        if self.ranks <= 0 or p % self.ranks or self.nodes <= 0 or self.ranks % self.nodes:
            raise ValueError(f"Placement of {p} slots on ranks={self.ranks}, nodes={self.nodes}: ranks must "
                             "divide the slots and nodes the ranks")
        held = set(self.phy2log)
        if held != set(range(self.experts)):
            missing = sorted(set(range(self.experts)) - held)
            extra = sorted(held - set(range(self.experts)))
            raise ValueError(f"Placement.phy2log must hold every expert of 0..{self.experts - 1} and no "
                             f"other: missing {missing[:8]}, out of range {extra[:8]}")

    @staticmethod
    def identity(experts: int, ranks: int, nodes: int = 1) -> Placement:
        return Placement(tuple(range(experts)), experts, ranks, nodes)

    @property
    def slots(self) -> int:
        return len(self.phy2log)

    @property
    def slots_per_rank(self) -> int:
        return self.slots // self.ranks

    @property
    def is_identity(self) -> bool:
        return self.phy2log == tuple(range(self.experts))

    def digest(self) -> int:
        """31 bits of ``phy2log`` (part of every call's agreement: ranks must place alike)."""
        return zlib.crc32(np.array(self.phy2log, np.int64).tobytes()) >> 1

    def replicas(self) -> np.ndarray:
        """[experts] replicas of each logical expert that take tokens (spares do not)."""
        return np.bincount(np.array(self.phy2log)[self.used], minlength=self.experts)

    @functools.cached_property
    def used(self) -> np.ndarray:
        """[slots] bool: the slot takes tokens, being its expert's first on its rank (a
        later one is a spare)."""
        pairs = np.array(self.phy2log) * self.ranks + self.slot_rank()
        first = np.zeros(self.slots, bool)
        first[np.unique(pairs, return_index=True)[1]] = True
        return first

    @functools.cached_property
    def spread(self) -> tuple[int, ...]:
        """The logical experts held on more than one rank (their gradient rows are summed
        across ranks when each rank stores its own slots): those with more than one used
        slot, a used slot being the first of its expert on its rank."""
        return tuple(int(e) for e in np.flatnonzero(self.replicas() > 1))

    def slot_rank(self) -> np.ndarray:
        """[slots] the rank holding each slot."""
        return np.arange(self.slots) // self.slots_per_rank

    def physical_spec(self, moe: MoESpec) -> MoESpec:
        """The layer the region computes: one expert per slot (routing is done: no groups)."""
        if moe.experts != self.experts:
            raise ValueError(f"Placement is for {self.experts} experts, the layer has {moe.experts}")
        return replace(moe, experts=self.slots, groups=1, top_groups=1)

    def physical_ids(self, ids: torch.Tensor, token_rank: torch.Tensor,
                     token_index: torch.Tensor) -> torch.Tensor:
        """ids [N, k] logical -> [N, k] physical slots for tokens on ranks ``token_rank``
        [N] with global indices ``token_index`` [N] (see the module doc)."""
        if self.is_identity:
            return ids
        choices, counts = (torch.as_tensor(t, device=ids.device) for t in self._choices)
        rank = token_rank.to(ids.device).unsqueeze(1).expand_as(ids)
        salt = torch.arange(ids.shape[1], device=ids.device)
        pick = (token_index.to(ids.device).unsqueeze(1) + salt) % counts[ids, rank]
        return choices[ids, rank, pick]

    @functools.cached_property
    def _choices(self) -> tuple[np.ndarray, np.ndarray]:
        """[E, ranks, R] the replicas a token on each rank may use (padded) and [E, ranks]
        how many: the one on its rank, else those on its node, else all; of two slots of
        an expert on one rank only the first is used (the other is a spare)."""
        where, rpn = self.slot_rank(), self.ranks // self.nodes
        slots = [[s for s, x in enumerate(self.phy2log) if x == e and self.used[s]]
                 for e in range(self.experts)]
        lists = [[[s for s in mine if where[s] == r][:1] or [s for s in mine if where[s] // rpn == r // rpn]
                  or mine for r in range(self.ranks)] for mine in slots]
        width = max(len(c) for row in lists for c in row)
        choices = np.zeros((self.experts, self.ranks, width), np.int64)
        counts = np.zeros((self.experts, self.ranks), np.int64)
        for e, row in enumerate(lists):
            for r, c in enumerate(row):
                choices[e, r, :len(c)], counts[e, r] = c, len(c)
        return choices, counts

    def slot_weights(self, w: ExpertWeights) -> ExpertWeights:
        """The region's weights, each slot reading its logical expert's row in place
        (``ExpertWeights.slot_rows``: nothing copied; a path's gradient of a row is its
        logical expert's); the router is done with (``ExpertWeights.routed``)."""
        return ExpertWeights.routed(self.physical_spec(w.spec), w.w13, w.w2, w.shared_w13, w.shared_w2,
                                    *w.biases, slot_rows=self.phy2log)

    def physical_weights(self, w: ExpertWeights) -> ExpertWeights:
        """The region's weights with each slot's copied from its logical expert's (a
        differentiable gather: a physical layer built once, or one for a path that reads
        no slot rows; ``ExpertWeights.gathered`` fills one rank's slots alone)."""
        return self.slot_weights(w).gathered()


# ---------------------------------------------------------------------------- planner


def replicate(load: np.ndarray, slots: int, most: int) -> np.ndarray:
    """Replicas per expert for ``slots`` slots: one each, then one more for the expert
    with the highest load per replica until the slots are used (EPLB's greedy), at most
    ``most`` each (a token uses the replica on its own rank: two on one rank would
    share its tokens with neither gaining)."""
    load = np.asarray(load, np.float64)
    if not len(load) <= slots <= len(load) * most:
        raise ValueError(f"slots={slots} must be between the {len(load)} experts and {most} replicas of each")
    counts = np.ones(len(load), np.int64)
    for _ in range(slots - len(load)):
        per = np.where(counts < most, load / counts, -1.0)
        counts[int(np.argmax(per))] += 1
    return counts


def plan_placement(load: np.ndarray, ranks: int, redundant: int = 0, nodes: int = 1,
                   current: Placement | None = None, spread: int | None = None) -> Placement:
    """The placement of ``len(load)`` experts with ``redundant`` extra slots on ``ranks``
    ranks (``nodes`` nodes), ``spread`` of them (default: all) replicas of the most loaded
    experts (``replicate``): pack the replicas heaviest first onto the least loaded node,
    and within it onto the least loaded rank, with a free slot and, where possible, no
    replica of the same expert (balanced packing, hierarchical over nodes); then fill each
    rank's free slots with spares, second copies of its heaviest expert (they take no
    tokens and are never read: a layer keeps its parameters' shapes with fewer
    replicas than slots).  With
    ``current``, the packed ranks of each node are renumbered to keep as many experts
    where ``current`` holds them as a greedy matching finds (the same loads, fewer rows to
    move).  Raises ``ValueError`` naming the field when the slots do not divide over the
    ranks."""
    load = np.asarray(load, np.float64)
    experts, slots = len(load), len(load) + redundant
    if redundant < 0 or ranks <= 0 or slots % ranks or nodes <= 0 or ranks % nodes:
        raise ValueError(f"redundant={redundant}: the {experts} experts plus the redundant slots must divide "
                         f"over ranks={ranks} (nodes={nodes} dividing the ranks)")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must be finite and >= 0 for every expert")
    spread = redundant if spread is None else spread
    if not 0 <= spread <= redundant:
        raise ValueError(f"spread={spread} must be between 0 and redundant={redundant}")
    counts = replicate(load, experts + spread, ranks)
    items = sorted(((load[e] / counts[e], e) for e in range(experts) for _ in range(counts[e])),
                   key=lambda item: (-item[0], item[1]))
    per_rank, rpn = slots // ranks, ranks // nodes
    node_of = _pack(items, nodes, per_rank * rpn)
    held: list[list[int]] = [[] for _ in range(ranks)]
    rank_load = np.zeros(ranks)
    for (share, e), node in zip(items, node_of, strict=True):
        options = [r for r in range(node * rpn, (node + 1) * rpn) if len(held[r]) < per_rank]
        fresh = [r for r in options if e not in held[r]] or options
        r = min(fresh, key=lambda q: (rank_load[q], q))
        held[r].append(e)
        rank_load[r] += share
    if any(not mine for mine in held):
        raise ValueError(f"spread={spread}: {experts + spread} experts and replicas leave a rank of "
                         f"ranks={ranks} without an expert to hold spares of")
    held = [mine + mine[:1] * (per_rank - len(mine)) for mine in held]  # heaviest first: spares of it
    held = [sorted(mine) for mine in held] if current is None else _keep_in_place(held, current, rpn)
    return Placement(tuple(e for mine in held for e in mine), experts, ranks, nodes)


def _keep_in_place(held: list[list[int]], current: Placement, rpn: int) -> list[list[int]]:
    """``held`` with the ranks of each node of ``rpn`` ranks renumbered, pairs of most
    experts in common with ``current``'s ranks first, and each rank's experts ordered to
    keep ``current``'s slot of those it already holds (a kept row is not copied)."""
    per = current.slots_per_rank
    now = [list(current.phy2log[r * per:(r + 1) * per]) for r in range(current.ranks)]
    out: list[list[int]] = [[] for _ in held]
    for first in range(0, len(held), rpn):
        ranks = range(first, first + rpn)
        pairs = sorted((-len(set(now[r]) & set(held[p])), r, p) for r in ranks for p in ranks)
        free_r, free_p = set(ranks), set(ranks)
        for _, r, p in pairs:
            if r in free_r and p in free_p:
                out[r] = _in_slots(held[p], now[r])
                free_r.discard(r)
                free_p.discard(p)
    return out


def _in_slots(experts: list[int], now: list[int]) -> list[int]:
    """``experts`` ordered so that each one ``now`` holds keeps its index there."""
    rest = sorted(experts)
    slots: list[int | None] = [None] * len(experts)
    for j, e in enumerate(now[:len(slots)]):
        if e in rest:
            slots[j] = e
            rest.remove(e)
    return [e if e is not None else rest.pop(0) for e in slots]


def _pack(items: list[tuple[float, int]], bins: int, capacity: int) -> list[int]:
    """The bin (node) of each (load, expert) item: heaviest first onto the least loaded
    bin with room, one not holding that expert yet where there is one."""
    fill, load, held, out = [0] * bins, np.zeros(bins), [set() for _ in range(bins)], []
    for share, e in items:
        room = [b for b in range(bins) if fill[b] < capacity]
        b = min([b for b in room if e not in held[b]] or room, key=lambda q: (load[q], q))
        fill[b] += 1
        load[b] += share
        held[b].add(e)
        out.append(b)
    return out


def rank_loads(placement: Placement, load: np.ndarray) -> np.ndarray:
    """[ranks] each rank's load when an expert's load splits evenly over its replicas."""
    load = np.asarray(load, np.float64)
    phy = list(placement.phy2log)
    share = np.where(placement.used, load[phy] / placement.replicas()[phy], 0.0)
    return np.bincount(placement.slot_rank(), weights=share, minlength=placement.ranks)


def starting_placement(experts: int, ranks: int, redundant: int = 0, nodes: int = 1) -> Placement:
    """Where a layer's experts are before any load is measured: the identity, or with
    ``redundant`` slots the planner's on a uniform load with every extra slot a spare (a
    layer storing only its own slots holds that many from the start, so its parameters
    keep their shapes; no expert is on two ranks until a load asks for it)."""
    if not redundant:
        return Placement.identity(experts, ranks, nodes)
    return plan_placement(np.ones(experts), ranks, redundant, nodes, spread=0)


def place_on_load(routing: Routing, moe: MoESpec, par: ParallelSpec,
                  redundant: int) -> tuple[Routing, MoESpec, Placement]:
    """A placement planned on ``routing``'s own per-expert load (every rank's tokens, in
    rank order) from the ``starting_placement`` (experts kept where they are), and the
    physical routing and layer under it: what a benchmark or a simulation balances with
    the load it measures."""
    load = torch.bincount(routing.ids.flatten(), minlength=moe.experts).double().numpy()
    start = starting_placement(moe.experts, par.ep, redundant, par.nodes)
    placement = plan_placement(load, par.ep, redundant, par.nodes, current=start)
    tokens = torch.arange(routing.ids.shape[0], device=routing.ids.device)
    ids = placement.physical_ids(routing.ids, tokens // par.tokens_per_rank, tokens)
    return Routing(ids, routing.weights), placement.physical_spec(moe), placement

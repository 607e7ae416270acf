"""The exact executor: every EP rank of a region, virtual, in one process.

Tasks run one at a time in any valid global order (default: task-id order when
valid, else a topological order).  Each rank's tasks are the very ``RankProgram``
and task callables the multi-rank runtime runs (``program.task_calls``); the only
differences are who walks the tasks (one loop over a global order instead of worker
threads over queues) and the put, a copy between two ranks' buffers in one address
space.  Because every tile is computed by exactly one task over its full reduction,
and the combine sums slots in a fixed order in fp32, the output is bitwise the same
under every valid order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..ir.graph import TaskGraph
from ..ir.semantics import EventCounts
from ..ir.verify import random_order
from ..regions.base import Region
from ..regions.dedup_kernels import DedupBuffers
from ..regions.family import region_family
from ..regions.kernels import FORWARD, ForwardBuffers, RankContext, expert_fields
from ..regions.slot_routing import SlotRouting, live_rows, resolve_slots
from ..regions.slots import SlotPlan
from ..routing import Routing, RoutingPlan, check_input, plan_routing
from ..spec import MoESpec, ParallelSpec, TileSpec
from ..weights import ExpertWeights
from .program import PeerView, rank_program, task_calls

DEFAULT_TILES = TileSpec()
Order = Sequence[int] | np.ndarray | int | None


@dataclass
class ForwardResult:
    """out: [N, H] spec.dtype.  buffers: each rank's buffers after the run
    (``recv`` holds dispatched rows, ``comb`` the combined expert outputs).
    plan: the routing plan the region ran (None: a per-shape plan's, ``prepare_slot_forward``);
    graph: its task graph."""

    out: torch.Tensor
    buffers: list[ForwardBuffers] | list[DedupBuffers]
    plan: RoutingPlan | None
    graph: TaskGraph


def _copy_put(buffers: Sequence[object]) -> Callable[..., None]:
    """The in-process put between the virtual ranks' buffers (its signals are counted
    by ``run_graph``'s ``EventCounts`` when the put ends)."""
    def put(peer: int, view: PeerView, rows: torch.Tensor, signals: tuple[int, ...], seq: int) -> None:
        getattr(buffers[peer], view.field)[view.row0:view.row0 + view.rows].copy_(rows)
    return put


def run_graph(graph: TaskGraph, region: Region, buffers: Sequence[object], contexts: Sequence[object],
              order: Sequence[int] | np.ndarray | None = None) -> None:
    """Run every task of ``graph`` (every rank's) once, in the global ``order`` (default:
    task-id order), with ``region``'s kernels and puts; ``buffers`` and ``contexts`` are
    per rank, of the region's types.  The reference of the IR's synchronisation
    (``ir.semantics.EventCounts``): raises ``GraphError`` when a task would run before its
    event reached its threshold."""
    order = np.arange(graph.num_tasks) if order is None else np.asarray(order, np.int64)
    if sorted(order.tolist()) != list(range(graph.num_tasks)):
        raise ValueError(f"order must be a permutation of the {graph.num_tasks} task ids")
    programs = [rank_program(graph, region, r) for r in range(graph.ep)]
    put = _copy_put(buffers)
    calls = [task_calls(p, region.kernels, buffers[r], contexts[r], put) for r, p in enumerate(programs)]
    local = np.zeros(graph.num_tasks, np.int64)
    for p in programs:
        local[p.task_ids] = np.arange(p.num_tasks)
    counts = EventCounts(graph)
    for g, i in zip(order.tolist(), local[order].tolist(), strict=True):
        counts.start(g)
        calls[int(graph.rank[g])][i]()
        counts.signal(g)


@dataclass(frozen=True)
class PreparedForward:
    """A forward region lowered for ``ep`` virtual ranks, with every rank's buffers and
    contexts, ready for ``run_graph`` (plan None: a per-shape plan's region)."""

    plan: RoutingPlan | None
    region: Region
    graph: TaskGraph
    buffers: list
    contexts: list

    def run(self, order: Sequence[int] | np.ndarray | None = None,
            graph: TaskGraph | None = None) -> ForwardResult:
        """Run every task once in ``order``, under ``graph``'s waits (default: the
        region's own graph; another one: the same tasks with altered waits)."""
        graph = self.graph if graph is None else graph
        run_graph(graph, self.region, self.buffers, self.contexts, order)
        return ForwardResult(out=torch.cat([b.out for b in self.buffers]), buffers=self.buffers,
                             plan=self.plan, graph=graph)


def execute_forward(x: torch.Tensor, weights: ExpertWeights, routing: Routing, ep: int,
                    tiles: TileSpec = DEFAULT_TILES, order: Order = None, nodes: int = 1,
                    checked: bool = False) -> ForwardResult:
    """Lower and run the forward region of ``ep`` virtual ranks on ``nodes`` nodes.

    x: [N, H] spec.dtype, split evenly over ranks.  ``order``: task ids, or an int
    seed for a random valid order, or None (task-id order).  checked: the caller has
    checked x and routing (``routing.check_input``)."""
    prepared = prepare_forward(x, weights, routing, ep, tiles, nodes, checked)
    if isinstance(order, int):
        order = random_order(prepared.graph, order)
    return prepared.run(order)


def prepare_forward(x: torch.Tensor, weights: ExpertWeights, routing: Routing, ep: int,
                    tiles: TileSpec = DEFAULT_TILES, nodes: int = 1,
                    checked: bool = False) -> PreparedForward:
    """The forward region of ``execute_forward``, lowered and allocated, not run."""
    spec = weights.spec
    if not checked:
        check_input(x, routing, spec)
    if not isinstance(ep, int) or ep <= 0 or x.shape[0] % ep:
        raise ValueError(f"ep={ep!r} must be a positive int dividing the {x.shape[0]} tokens")
    par = ParallelSpec(ep=ep, tokens_per_rank=x.shape[0] // ep, nodes=nodes)
    plan = plan_routing(routing.ids, spec, par, checked)
    family = region_family(tiles)
    layout = family.layout(plan, tiles)
    region = family.forward(layout)
    graph = region.graph(plan, tiles)
    xs = x.chunk(ep) if x.shape[0] else [x] * ep
    buffers = [family.forward_buffers(xs[r], layout, tiles, r) for r in range(ep)]
    contexts = [family.forward_context(weights, layout, family.rank_routing(routing, plan, r), r)
                for r in range(ep)]
    return PreparedForward(plan=plan, region=region, graph=graph, buffers=buffers, contexts=contexts)


def prepare_slot_forward(plan: SlotPlan, x: torch.Tensor, weights: ExpertWeights, routing: Routing,
                         checked: bool = False) -> PreparedForward:
    """The forward region of the per-shape ``plan`` for this call's ``routing``: the
    plan's graph, its slot tasks resolved (``resolved_graph``), on one rank's buffers
    of the slot layout.  x: [plan.shape.tokens, H] spec.dtype; checked: as in
    ``prepare_forward``."""
    spec, shape = weights.spec, plan.shape
    if not checked:
        check_input(x, routing, spec)
    if spec != shape.moe or x.shape[0] != shape.tokens:
        raise ValueError(f"the plan is for {shape.tokens} tokens of {shape.moe}, got {x.shape[0]} of {spec}")
    slots = resolve_slots(routing.ids, shape)
    mine = weights.local(slice(0, spec.experts))
    ctx = RankContext(weights, mine.w13, mine.w2, slots.row_token, slots.pos, routing.weights, mine.b13,
                      mine.b2)
    return PreparedForward(plan=None, region=FORWARD, graph=resolved_graph(plan, slots),
                           buffers=[slot_buffers(x, spec, shape.capacity)], contexts=[ctx])


def resolved_graph(plan: SlotPlan, slots: SlotRouting) -> TaskGraph:
    """``plan``'s graph with each slot task's rows cut to its live rows and its expert
    the one its slot serves this call, and each expert task over its expert's rows;
    waits, signals and thresholds unchanged."""
    st, et, g = plan.slot_tasks, plan.expert_tasks, plan.graph
    as_t = torch.from_numpy
    m = live_rows(slots.slot_rows.cpu(), as_t(st.slot), as_t(st.offset), as_t(st.cap)).numpy()
    row0, row1, expert = g.row0.copy(), g.row1.copy(), g.expert.copy()
    row1[st.task] = g.row0[st.task] + m
    expert[st.task] = slots.slot_expert.cpu().numpy()[st.slot]
    row0[et.task] = slots.first.cpu().numpy()[et.expert] * plan.shape.tiles.gemm_rows
    row1[et.task] = row0[et.task] + slots.counts.cpu().numpy()[et.expert]
    return dataclasses.replace(g, row0=row0, row1=row1, expert=expert)


def slot_buffers(x: torch.Tensor, spec: MoESpec, capacity: int) -> ForwardBuffers:
    """One rank's forward buffers for ``x`` [T, H] whose permuted buffers hold the
    ``capacity`` rows of a slot layout (uninitialised)."""
    comb = torch.empty(capacity, spec.hidden, dtype=spec.dtype, device=x.device)
    return ForwardBuffers(**expert_fields(x, spec, capacity, capacity), comb=comb)

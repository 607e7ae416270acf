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
from ..regions.kernels import ForwardBuffers
from ..routing import Routing, RoutingPlan, check_input, plan_routing
from ..spec import ParallelSpec, TileSpec
from ..weights import ExpertWeights
from .program import PeerView, rank_program, task_calls

DEFAULT_TILES = TileSpec()
Order = Sequence[int] | np.ndarray | int | None


@dataclass
class ForwardResult:
    """out: [N, H] spec.dtype.  buffers: each rank's buffers after the run
    (``recv`` holds dispatched rows, ``comb`` the combined expert outputs).
    plan: the routing plan the region ran; graph: its task graph."""

    out: torch.Tensor
    buffers: list[ForwardBuffers] | list[DedupBuffers]
    plan: RoutingPlan
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
    contexts, ready for ``run_graph``."""

    plan: RoutingPlan
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
    plan = plan_routing(routing.ids, spec, par)
    family = region_family(tiles)
    layout = family.layout(plan, tiles)
    region = family.forward(layout)
    graph = region.lower(plan, tiles, None)
    xs = x.chunk(ep) if x.shape[0] else [x] * ep
    buffers = [family.forward_buffers(xs[r], layout, tiles, r) for r in range(ep)]
    contexts = [family.forward_context(weights, layout, family.rank_routing(routing, plan, r), r)
                for r in range(ep)]
    return PreparedForward(plan=plan, region=region, graph=graph, buffers=buffers, contexts=contexts)

"""The exact executor: every EP rank of a task graph, virtual, in one process.

Tasks run one at a time in any valid order (default: task-id order when valid,
else a topological order); each runs its kernel on views of per-rank buffers.
Because every tile is computed by exactly one task over its full reduction, and
the combine sums slots in a fixed order in fp32, the output is bitwise the same
under every valid order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..ir.graph import TaskGraph, TaskKind
from ..ir.verify import GraphError, random_order
from ..regions.forward import lower_forward
from ..regions.kernels import KERNELS, ForwardBuffers, RankContext, tiles_of
from ..routing import Routing, check_hidden, check_routing, plan_routing
from ..spec import ParallelSpec, TileSpec
from ..weights import ExpertWeights
from .backend import Backend, as_backend

DEFAULT_TILES = TileSpec()


@dataclass
class ForwardResult:
    """out: [N, H] spec.dtype.  buffers: each rank's buffers after the run
    (``recv`` holds dispatched rows, ``comb`` the combined expert outputs)."""

    out: torch.Tensor
    buffers: list[ForwardBuffers]
    graph: TaskGraph


def run_graph(graph: TaskGraph, buffers: Sequence[ForwardBuffers], contexts: Sequence[RankContext],
              order: Sequence[int] | np.ndarray | None = None,
              kernels: Mapping[TaskKind, Callable[..., None]] | None = None) -> None:
    """Run every task of ``graph`` once, in ``order``; raise ``GraphError`` when a
    task would run before its event reached its threshold.  ``kernels``: the
    ``{TaskKind: fn(tile, me, peer, ctx)}`` table (default: the forward ``KERNELS``);
    ``buffers`` and ``contexts`` are whatever that table's functions take."""
    table = KERNELS if kernels is None else kernels
    order = np.arange(graph.num_tasks) if order is None else np.asarray(order, np.int64)
    if sorted(order.tolist()) != list(range(graph.num_tasks)):
        raise ValueError(f"order must be a permutation of the {graph.num_tasks} task ids")
    tiles = tiles_of(graph)
    wait, signals, ptr = graph.wait_global().tolist(), graph.signals_global().tolist(), graph.sig_ptr.tolist()
    threshold = graph.threshold.tolist()
    count = [0] * graph.num_events
    for i in order.tolist():
        ev = wait[i]
        if ev >= 0 and count[ev] < threshold[ev]:
            raise GraphError(f"order runs {graph.task(i)} before its event {ev} reached "
                             f"{threshold[ev]} (at {count[ev]})")
        t = tiles[i]
        table[t.kind](t, buffers[t.rank], buffers[t.peer], contexts[t.rank])
        for e in signals[ptr[i]:ptr[i + 1]]:
            count[e] += 1


def execute_forward(x: torch.Tensor, weights: ExpertWeights, routing: Routing, ep: int,
                    tiles: TileSpec = DEFAULT_TILES, order: Sequence[int] | np.ndarray | int | None = None
                    ) -> ForwardResult:
    """Lower and run the forward region of ``ep`` virtual ranks.

    x: [N, H] spec.dtype, split evenly over ranks.  ``order``: task ids, or an int
    seed for a random valid order, or None (task-id order)."""
    spec = weights.spec
    check_hidden(x, spec)
    check_routing(routing, spec, x.shape[0])
    if not isinstance(ep, int) or ep <= 0 or x.shape[0] % ep:
        raise ValueError(f"ep={ep!r} must be a positive int dividing the {x.shape[0]} tokens")
    par = ParallelSpec(ep=ep, tokens_per_rank=x.shape[0] // ep)
    plan = plan_routing(routing.ids, spec, par)
    graph = lower_forward(plan, tiles)
    if isinstance(order, int):
        order = random_order(graph, order)
    xs = x.chunk(ep) if x.shape[0] else [x] * ep
    buffers = [ForwardBuffers.allocate(xs[r], plan, r) for r in range(ep)]
    contexts = [RankContext.build(weights, plan, routing, r) for r in range(ep)]
    run_graph(graph, buffers, contexts, order)
    return ForwardResult(out=torch.cat([b.out for b in buffers]), buffers=buffers, graph=graph)


def moe_forward(x: torch.Tensor, weights: ExpertWeights, routing: Routing, ep: int = 1,
                tiles: TileSpec = DEFAULT_TILES, order: Sequence[int] | np.ndarray | int | None = None,
                backend: Backend | str = Backend.EXACT) -> torch.Tensor:
    """Routed plus shared-expert output [N, H] of the MoE layer, computed by the
    tile task graph of ``ep`` expert-parallel ranks (see ``execute_forward``).
    ``backend="triton"``: one persistent Triton kernel on ``x.device`` (``hpmoe.gpu``);
    ``order`` is then not used and must be None."""
    if as_backend(backend) is Backend.TRITON:
        if order is not None:
            raise ValueError(f"order={order!r}: the triton backend runs a schedule, not a task order")
        from ..gpu.backend import triton_forward
        return triton_forward(x, weights, routing, ep, tiles).out
    return execute_forward(x, weights, routing, ep, tiles, order).out

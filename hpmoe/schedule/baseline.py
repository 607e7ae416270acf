"""The strongest kernel-by-kernel baseline, and the paper's region, as graph variants.

``strongest_baseline`` models what a framework with DeepEP-style all-to-alls runs:
  1. dispatch and combine move one copy per (token, destination rank), not one per
     (token, expert): every put's link bytes (and payload read) shrink by its
     (source, destination) pair's ratio of distinct tokens to routed rows;
  2. the permute is fused into the dispatch (the put reads the token rows itself): the
     PERMUTE tasks cost nothing;
  3. the shared experts run beside the dispatch (off the barrier chain,
     ``serial_schedule(overlap_shared=True)``).
``paper_region`` empties the tasks the paper's fused kernel does not cover (permute,
unpermute, shared experts), so that a row can be restricted to its region.  An empty
task (no flops, bytes or link bytes) costs no time (``hpmoe.sim.cost.free_tasks``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..ir.graph import IS_PUT, TaskGraph, TaskKind
from ..ir.schedule import Schedule, WorkerCounts
from ..routing import RoutingPlan
from .serial import serial_schedule

PAPER_OUTSIDE = frozenset({TaskKind.PERMUTE, TaskKind.UNPERMUTE, TaskKind.SHARED_UP,
                           TaskKind.SHARED_SWIGLU, TaskKind.SHARED_DOWN})


def with_free_kinds(graph: TaskGraph, kinds: frozenset[TaskKind] | set[TaskKind]) -> TaskGraph:
    """``graph`` whose tasks of ``kinds`` are empty: no flops, bytes or link bytes."""
    free = np.isin(graph.kind, [int(k) for k in kinds])
    zero = {name: np.where(free, 0.0, getattr(graph, name)) for name in ("flops", "bytes", "link_bytes")}
    return replace(graph, **zero)


def paper_region(graph: TaskGraph) -> TaskGraph:
    """The paper's kernel region: dispatch -> GEMM -> SwiGLU -> GEMM -> combine."""
    return with_free_kinds(graph, PAPER_OUTSIDE)


def dedup_ratio(plan: RoutingPlan) -> np.ndarray:
    """[ep, ep] distinct tokens over routed rows each source sends each destination (1
    where it sends none)."""
    ep, k, local = plan.par.ep, plan.moe.top_k, plan.local_experts
    ratio = np.ones((ep, ep))
    offsets = plan.send_offsets.numpy()
    for s in range(ep):
        token = plan.order[s].numpy() // k
        dest = (np.searchsorted(offsets[s], np.arange(len(token)), side="right") - 1) // local
        rows = np.bincount(dest, minlength=ep)
        distinct = np.bincount(np.unique(token * ep + dest) % ep, minlength=ep)
        ratio[s] = np.divide(distinct, rows, out=np.ones(ep), where=rows > 0)
    return ratio


def dedup_puts(graph: TaskGraph, plan: RoutingPlan) -> TaskGraph:
    """``graph`` (lowered from ``plan``) with each dispatch and combine put's link bytes
    and bytes scaled by its (token source, destination) pair's ``dedup_ratio``."""
    ratio = dedup_ratio(plan)
    combine = graph.kind == TaskKind.COMBINE
    src = np.where(combine, graph.peer, graph.rank)
    dst = np.where(combine, graph.rank, graph.peer)
    scale = np.where(IS_PUT[graph.kind], ratio[src, dst], 1.0)
    return replace(graph, link_bytes=graph.link_bytes * scale, bytes=graph.bytes * scale)


def strongest_baseline(graph: TaskGraph, plan: RoutingPlan, workers: WorkerCounts) -> Schedule:
    """The kernel-by-kernel schedule of the module plan, on a forward graph lowered from
    ``plan``."""
    g = with_free_kinds(dedup_puts(graph, plan), {TaskKind.PERMUTE})
    return serial_schedule(g, workers, overlap_shared=True)

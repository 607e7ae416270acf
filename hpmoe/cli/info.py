"""``hpmoe info``: what the task graph of one configuration holds."""

from __future__ import annotations

import argparse
import time

import numpy as np

from ..ir.graph import TaskGraph, TaskKind, Unit
from ..regions.forward import lower_forward
from .common import add_layer_args, emit, layer_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="task counts, events, bytes and flops of a configuration")
    add_layer_args(p)
    p.add_argument("--rank", type=int, default=None, help="lower only this rank's graph")
    p.set_defaults(run=run)


def graph_summary(graph: TaskGraph) -> dict:
    """Counts per kind and unit, events, bytes moved and flops, per rank on average."""
    ranks = len(graph.ranks)
    kinds = np.bincount(graph.kind, minlength=len(TaskKind))
    units = np.bincount(graph.unit, minlength=len(Unit))
    link = np.bincount(graph.rank, weights=graph.link_bytes, minlength=graph.ep)[list(graph.ranks)]
    return {
        "tasks": int(graph.num_tasks),
        "tasks_per_kind": {k.name.lower(): int(kinds[k]) for k in TaskKind if kinds[k]},
        "tasks_per_unit": {u.name.lower(): int(units[u]) for u in Unit},
        "events": int(graph.num_events),
        "signals": int(len(graph.sig_event)),
        "link_bytes_per_rank_max": int(round(float(link.max(initial=0)))),
        "link_bytes_per_rank_mean": int(round(float(link.mean()))) if ranks else 0,
        "memory_bytes": int(graph.bytes.sum()),
        "flops": int(graph.flops.sum()),
    }


def run(args: argparse.Namespace) -> int:
    layer = layer_from_args(args)
    ranks = None if args.rank is None else (args.rank,)
    start = time.perf_counter()
    graph = lower_forward(layer.plan, layer.tiles, ranks)
    elapsed = time.perf_counter() - start
    head = {"preset": args.preset, "ep": args.ep, "tokens_per_rank": args.tokens,
            "routing": layer.routing.value, "ranks_lowered": len(graph.ranks),
            "lowering_ms": round(elapsed * 1e3, 2)}
    emit(head | graph_summary(graph), args.json)
    return 0

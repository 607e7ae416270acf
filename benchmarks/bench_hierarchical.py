"""Hierarchical (per-node) against flat deduplicated dispatch on a two-tier cluster:
link bytes per tier and the simulated Dispatch-to-Combine makespan of the taskflow and
of the kernel-by-kernel baselines, DeepSeek-V3 grouped routing, 8 ranks per node.

    .venv/bin/python benchmarks/bench_hierarchical.py [--eps 16 32 64] [--tokens 1024]
        [--hardware h100] [--ranks-per-node 8] [--json]

Baselines (kernel by kernel, a barrier between kernels, shared experts beside the
dispatch, the permute fused into the dispatch):
  serial-dedup       the strongest baseline of ``hpmoe reproduce``: the per-expert graph
                     with each put's bytes scaled to one row per (token, destination rank);
  serial-dedup-node  the per-node graph (bf16 partials): one row per (token, node)
                     between nodes, forwarded within the node (the forward's gather
                     fused too); its partial reduce, node reduce and partial sum run.
"Ours" is ``SchedulePolicy.CRITICAL_PATH`` (the fastest of its candidates) on the
per-expert, per-rank and per-node graphs (bf16 partials).
"""

from __future__ import annotations

import argparse
import json

import torch

from hpmoe.ir.graph import TaskGraph, TaskKind
from hpmoe.machine import record
from hpmoe.regions import RegionKind, region
from hpmoe.routing import RoutingKind, plan_routing, ranks_per_token, synthetic_routing
from hpmoe.schedule import SchedulePolicy, WorkerCounts, schedule, serial_schedule
from hpmoe.schedule.baseline import strongest_baseline, with_free_kinds
from hpmoe.sim.bounds import graph_bounds
from hpmoe.sim.cost import tier_link_bytes
from hpmoe.sim.presets import hardware_preset
from hpmoe.sim.simulate import simulate
from hpmoe.spec import DispatchMode, ParallelSpec, TileSpec, preset

_US = 1e6
VARIANTS = {"per-expert": (RegionKind.FORWARD, TileSpec()),
            "per-rank": (RegionKind.FORWARD_DEDUP,
                         TileSpec(dispatch=DispatchMode.PER_RANK, partial_dtype=torch.bfloat16)),
            "per-node": (RegionKind.FORWARD_DEDUP,
                         TileSpec(dispatch=DispatchMode.PER_NODE, partial_dtype=torch.bfloat16))}


def tier_bytes(graph: TaskGraph) -> tuple[float, float]:
    """(intra-node, inter-node) link bytes of the busiest rank, MB."""
    intra, inter = tier_link_bytes(graph).max(axis=1) / 1e6
    return float(intra), float(inter)


def node_baseline(graph: TaskGraph, workers: WorkerCounts):
    """Kernel by kernel on the per-node graph, permute and relay gather fused into the puts."""
    free = with_free_kinds(graph, {TaskKind.PERMUTE, TaskKind.RELAY_PACK})
    return serial_schedule(free, workers, overlap_shared=True)


def row(ep: int, tokens: int, hw_name: str, rpn: int, seed: int) -> dict:
    moe = preset("deepseek-v3", torch.bfloat16)
    par = ParallelSpec(ep=ep, tokens_per_rank=tokens, nodes=max(ep // rpn, 1))
    ids = synthetic_routing(RoutingKind.GROUPED, moe, par, seed=seed).ids
    plan = plan_routing(ids, moe, par)
    hw = hardware_preset(hw_name)
    workers = hw.workers
    out = {"hardware": hw_name, "ep": ep, "nodes": par.nodes, "tokens_per_rank": tokens,
           "ranks_per_token": round(ranks_per_token(ids, moe, par), 3)}
    graphs = {name: region(kind).lower(plan, tiles, None) for name, (kind, tiles) in VARIANTS.items()}
    for name, g in graphs.items():
        intra, inter = tier_bytes(g)
        out[f"{name}_intra_MB"], out[f"{name}_inter_MB"] = round(intra, 3), round(inter, 3)
        ours = simulate(schedule(g, SchedulePolicy.CRITICAL_PATH, hw), hw)
        out[f"{name}_us"] = round(ours.makespan * _US, 1)
    out["serial-dedup_us"] = round(simulate(strongest_baseline(graphs["per-expert"], plan, workers),
                                            hw).makespan * _US, 1)
    out["serial-dedup-node_us"] = round(simulate(node_baseline(graphs["per-node"], workers), hw).makespan
                                        * _US, 1)
    bound = graph_bounds(graphs["per-node"], hw)
    out["per-node_bound_us"] = round(bound.lower_bound * _US, 1)
    out["per-node_bounds_us"] = {k: round(v * _US, 1) for k, v in
                                 (("matrix", bound.matrix_work), ("vector", bound.vector_work),
                                  ("link", bound.link), ("critical_path", bound.critical_path),
                                  ("memory", bound.memory))}
    strongest = min(out["serial-dedup_us"], out["serial-dedup-node_us"])
    ours = min(out[f"{n}_us"] for n in VARIANTS)
    out["speedup_over_strongest"] = round(strongest / ours, 3)
    out["at_most"] = round(strongest / out["per-node_bound_us"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--eps", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    record()
    for ep in args.eps:
        r = row(ep, args.tokens, args.hardware, args.ranks_per_node, args.seed)
        print(json.dumps(r) if args.json else "  ".join(f"{k}={v}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()

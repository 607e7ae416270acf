"""``hpmoe reproduce``: the paper's Dispatch-to-Combine table on a hardware model.

DeepSeek-V3 shapes, 4096 tokens per rank, EP in {8, 16, 32, 64}, DeepSeek-V3's
group-limited routing (``grouped``) by default.  Per row, in µs: the strongest
kernel-by-kernel baseline (``serial-dedup``: deduplicated all-to-alls with the permute
fused, shared experts beside the dispatch; forward only), today's serial baseline,
the paper's policy on the paper's tiles, ours (critical-path) and the lower bound of
our graph, with speedups over the strongest baseline first.  Each forward
configuration has a second row restricted to the paper's region (dispatch -> GEMM ->
SwiGLU -> GEMM -> combine: permute, unpermute and shared experts cost nothing), and
forward rows carry the paper's own figure, ``paper_speedup`` = [1.49, 1.58] (serial /
HyperParallel-MoE under balanced routing, its region, measured on A3), where it
applies: the paper-region rows and balanced routing.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ..ir.graph import TaskGraph
from ..regions import RegionKind, region
from ..routing import RoutingKind, RoutingPlan, plan_routing, ranks_per_token, synthetic_routing
from ..schedule import critical_path_candidates, hyperparallel_schedule, paper_tiles
from ..schedule.baseline import paper_region, strongest_baseline
from ..sim.bounds import graph_bounds
from ..sim.hardware import HardwareModel
from ..sim.presets import HARDWARE_PRESETS
from ..sim.simulate import simulate
from ..spec import PRESETS, ParallelSpec, TileSpec, preset
from .common import emit
from .simulate import add_set_arg, hardware_from_args

_US = 1e6
PAPER_SPEEDUP = (1.49, 1.58)  # HyperParallel-MoE, serial / theirs, balanced routing, A3
COLUMNS = ("direction", "region", "ep", "routing", "ranks_per_token", "baseline", "baseline_us",
           "serial_us", "hyperparallel_us", "critical_path_us", "lower_bound_us", "memory_bound_us",
           "critical_path_speedup", "critical_path_speedup_serial", "hyperparallel_speedup",
           "paper_speedup", "critical_path_over_bound", "l2_hit_rate", "candidate")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reproduce", help="the paper's serial vs hyperparallel table, with ours and bounds")
    p.add_argument("--ep", type=int, nargs="+", default=[8, 16, 32, 64], help="EP sizes")
    p.add_argument("--routing", nargs="+", default=[RoutingKind.GROUPED.value],
                   choices=[k.value for k in RoutingKind], help="synthetic routings")
    p.add_argument("--direction", nargs="+", default=[RegionKind.FORWARD.value],
                   choices=[d.value for d in RegionKind], help="the regions to simulate")
    p.add_argument("--hardware", default="ascend-a3", choices=list(HARDWARE_PRESETS), help="hardware model")
    add_set_arg(p)
    p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS), help="MoE shape")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic routing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def reproduce_rows(args: argparse.Namespace, direction: RegionKind, ep: int, routing: RoutingKind,
                   hardware: HardwareModel) -> list[dict]:
    """The full-region row and, forward, the paper-region row of one configuration."""
    moe = preset(args.preset, torch.bfloat16)
    par = ParallelSpec(ep=ep, tokens_per_rank=args.tokens)
    ids = synthetic_routing(routing, moe, par, seed=args.seed).ids
    plan = plan_routing(ids, moe, par)
    graph, paper = (region(direction).graph(plan, tiles) for tiles in (TileSpec(), paper_tiles(hardware)))
    base = {"direction": direction.value, "ep": ep, "routing": routing.value,
            "ranks_per_token": round(ranks_per_token(ids, moe, par), 3)}
    regions = [("full", lambda g: g)]
    if direction is RegionKind.FORWARD:
        regions.append(("paper", paper_region))
    return [{**base, "region": name, **_row(cut(graph), cut(paper), plan, hardware, direction, routing, name)}
            for name, cut in regions]


def _row(graph: TaskGraph, paper: TaskGraph, plan: RoutingPlan, hardware: HardwareModel,
         direction: RegionKind, routing: RoutingKind, cut: str) -> dict:
    """One row's figures (see the module docstring)."""
    workers = hardware.workers
    candidates = critical_path_candidates(graph, hardware)
    best = min(candidates, key=lambda c: c.makespan)
    ours = simulate(best.schedule, hardware)
    serial = next(c.makespan for c in candidates if c.name == "serial")
    hyper = simulate(hyperparallel_schedule(paper, workers), hardware).makespan
    forward = direction is RegionKind.FORWARD
    baseline = simulate(strongest_baseline(graph, plan, workers), hardware).makespan if forward else serial
    bound = graph_bounds(graph, hardware)  # of the graph itself: valid for every schedule
    applies = forward and (cut == "paper" or routing is RoutingKind.BALANCED)
    cp = ours.makespan
    return {"baseline": "serial-dedup" if forward else "serial", "baseline_us": round(baseline * _US, 1),
            "serial_us": round(serial * _US, 1), "hyperparallel_us": round(hyper * _US, 1),
            "critical_path_us": round(cp * _US, 1), "lower_bound_us": round(bound.lower_bound * _US, 1),
            "memory_bound_us": round(bound.memory * _US, 1),
            "critical_path_speedup": round(baseline / cp, 3),
            "critical_path_speedup_serial": round(serial / cp, 3),
            "hyperparallel_speedup": round(baseline / hyper, 3),
            "paper_speedup": list(PAPER_SPEEDUP) if applies else None,
            "critical_path_over_bound": round(cp / bound.lower_bound, 4),
            "l2_hit_rate": round(float(ours.memory.l2_hit_rate.min()), 3), "candidate": best.name}


def format_table(rows: list[dict]) -> str:
    """Aligned text table of ``rows`` (``COLUMNS``), under the paper's own figure."""
    cells = [[_cell(r.get(h)) for h in COLUMNS] for r in rows]
    width = [max(len(h), *(len(c[j]) for c in cells)) for j, h in enumerate(COLUMNS)]
    line = "  ".join(h.rjust(w) for h, w in zip(COLUMNS, width, strict=True))
    paper = (f"paper (HyperParallel-MoE on A3, its region, balanced routing): serial / theirs = "
             f"{PAPER_SPEEDUP[0]}-{PAPER_SPEEDUP[1]}x")
    return "\n".join([paper, line] + ["  ".join(c.rjust(w) for c, w in zip(cell, width, strict=True))
                                      for cell in cells])


def _cell(value: object) -> str:
    if isinstance(value, list):
        return "-".join(str(v) for v in value)
    return "-" if value is None else str(value)


def run(args: argparse.Namespace) -> int:
    hardware = hardware_from_args(args)
    jobs = [(RegionKind(d), ep, RoutingKind(r)) for d in args.direction for r in args.routing
            for ep in args.ep]
    rows, start = [], time.perf_counter()
    for k, (direction, ep, routing) in enumerate(jobs, 1):
        rows += reproduce_rows(args, direction, ep, routing, hardware)
        print(f"[{k}/{len(jobs)}] {direction.value} EP {ep} {routing.value}: "
              f"{rows[-1]['baseline']} {rows[-1]['baseline_us']} us, "
              f"critical-path {rows[-1]['critical_path_us']} us ({time.perf_counter() - start:.1f} s)",
              file=sys.stderr, flush=True)
    if args.json:
        emit({"preset": args.preset, "tokens_per_rank": args.tokens, "hardware": hardware.name,
              "overrides": list(args.overrides), "paper_speedup": list(PAPER_SPEEDUP), "rows": rows}, True)
    else:
        print(format_table(rows))
    return 0

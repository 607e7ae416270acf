"""``hpmoe reproduce``: the paper's Dispatch-to-Combine table on a hardware model.

DeepSeek-V3 shapes, 4096 tokens per rank, EP in {8, 16, 32, 64}, balanced and
zipf-skewed routing, forward and backward regions.  Per row: the serial baseline,
the paper's policy on the paper's tiles, ours (critical-path) and the lower bound of
our graph, in µs, with speedups over serial.  Serial and critical-path use the
default tiles (128-row GEMM blocks, 512 columns); critical-path's candidates include
the serial schedule, so ``serial`` is read off the same run.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ..regions import RegionKind, region
from ..routing import RoutingKind, plan_routing, synthetic_routing
from ..schedule import WorkerCounts, critical_path_candidates, hyperparallel_schedule, paper_tiles
from ..sim.hardware import HARDWARE_PRESETS, HardwareModel, hardware_preset
from ..sim.simulate import graph_bounds, simulate
from ..spec import PRESETS, ParallelSpec, TileSpec, preset
from .common import emit

_US = 1e6
COLUMNS = ("direction", "ep", "routing", "serial_us", "hyperparallel_us", "critical_path_us",
           "lower_bound_us", "hyperparallel_speedup", "critical_path_speedup", "critical_path_over_bound")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reproduce", help="the paper's serial vs hyperparallel table, with ours and bounds")
    p.add_argument("--ep", type=int, nargs="+", default=[8, 16, 32, 64], help="EP sizes")
    p.add_argument("--routing", nargs="+", default=[RoutingKind.BALANCED.value, RoutingKind.ZIPF.value],
                   choices=[k.value for k in RoutingKind], help="synthetic routings")
    p.add_argument("--direction", nargs="+", default=[RegionKind.FORWARD.value, RegionKind.BACKWARD.value],
                   choices=[d.value for d in RegionKind], help="the regions to simulate")
    p.add_argument("--hardware", default="ascend-a3", choices=list(HARDWARE_PRESETS), help="hardware model")
    p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS), help="MoE shape")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic routing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def reproduce_row(args: argparse.Namespace, direction: RegionKind, ep: int, routing: RoutingKind,
                  hardware: HardwareModel) -> dict:
    """Serial, hyperparallel, critical-path and the lower bound for one region, EP size
    and routing."""
    moe = preset(args.preset, torch.bfloat16)
    par = ParallelSpec(ep=ep, tokens_per_rank=args.tokens)
    plan = plan_routing(synthetic_routing(routing, moe, par, seed=args.seed).ids, moe, par)
    graph = region(direction).lower(plan, TileSpec(), None)
    candidates = {c.name: c.makespan for c in critical_path_candidates(graph, hardware)}
    paper = region(direction).lower(plan, paper_tiles(hardware), None)
    hyper = simulate(hyperparallel_schedule(paper, WorkerCounts.from_hardware(hardware)), hardware).makespan
    serial, ours = candidates["serial"], min(candidates.values())
    bound = graph_bounds(graph, hardware).lower_bound
    return {"direction": direction.value, "ep": ep, "routing": routing.value,
            "serial_us": round(serial * _US, 1),
            "hyperparallel_us": round(hyper * _US, 1), "critical_path_us": round(ours * _US, 1),
            "lower_bound_us": round(bound * _US, 1), "hyperparallel_speedup": round(serial / hyper, 3),
            "critical_path_speedup": round(serial / ours, 3),
            "critical_path_over_bound": round(ours / bound, 4),
            "candidate": min(candidates, key=candidates.get)}


def format_table(rows: list[dict]) -> str:
    """Aligned text table of ``rows`` (``COLUMNS`` plus the winning candidate)."""
    heads = [*COLUMNS, "candidate"]
    cells = [[str(r[h]) for h in heads] for r in rows]
    width = [max(len(h), *(len(c[j]) for c in cells)) for j, h in enumerate(heads)]
    line = "  ".join(h.rjust(w) for h, w in zip(heads, width, strict=True))
    return "\n".join([line] + ["  ".join(c.rjust(w) for c, w in zip(cell, width, strict=True))
                               for cell in cells])


def run(args: argparse.Namespace) -> int:
    hardware = hardware_preset(args.hardware)
    jobs = [(RegionKind(d), ep, RoutingKind(r)) for d in args.direction for r in args.routing
            for ep in args.ep]
    rows, start = [], time.perf_counter()
    for k, (direction, ep, routing) in enumerate(jobs, 1):
        rows.append(reproduce_row(args, direction, ep, routing, hardware))
        print(f"[{k}/{len(jobs)}] {direction.value} EP {ep} {routing.value}: "
              f"serial {rows[-1]['serial_us']} us, "
              f"critical-path {rows[-1]['critical_path_us']} us ({time.perf_counter() - start:.1f} s)",
              file=sys.stderr, flush=True)
    if args.json:
        emit({"preset": args.preset, "tokens_per_rank": args.tokens, "hardware": hardware.name,
              "rows": rows}, True)
    else:
        print(format_table(rows))
    return 0

"""Measured Dispatch-to-Combine of per-expert, per-rank and per-node dispatch on CPU ranks
over shaped two-tier links: the multi-rank runtime (dist transport), each rank in its own
network namespace, ranks of one "node" joined at RATE per direction, ranks of different
nodes at INTER (``hpmoe.launch.netns``, tc htb).  Needs root, ``ip`` and ``tc``.

    flock -x /tmp/hpmoe-bench.lock .venv/bin/python benchmarks/bench_two_tier.py \\
        [--ep 4] [--ranks-per-node 2] [--rate 2gbit] [--inter 400mbit] [--tokens 256] \\
        [--preset small] [--repeats 7] [--json]

Per mode and repeat, every rank runs one forward region (``ForwardRunner``, critical-path
schedule cached after the first call, bf16 partials); the region's time is the slowest
rank's ``region_s`` (workers' run: dispatch to combine) and ``total`` adds the exchange,
scheduling and preparation of that call.  Rank 0 prints the medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from hpmoe.bench.forecast import slowest_rank
from hpmoe.launch.launcher import LaunchSpec, launch
from hpmoe.launch.netns import LinkSpec
from hpmoe.machine import record
from hpmoe.routing import Routing, RoutingKind, synthetic_routing
from hpmoe.runtime import ForwardOptions, ForwardRunner, RuntimeConfig, Session, TransportKind
from hpmoe.schedule import SchedulePolicy
from hpmoe.sim.hardware import LinkEntry
from hpmoe.sim.presets import cpu_nominal
from hpmoe.spec import DispatchMode, ParallelSpec, TileSpec, preset
from hpmoe.weights import ExpertWeights

MODES = (DispatchMode.PER_EXPERT, DispatchMode.PER_RANK, DispatchMode.PER_NODE)


def rank_body(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    moe = preset(args.preset, torch.bfloat16)
    par = ParallelSpec(world, args.tokens, nodes=world // args.ranks_per_node)
    every = synthetic_routing(RoutingKind.GROUPED, moe, par, seed=0)
    mine = slice(rank * args.tokens, (rank + 1) * args.tokens)
    x = torch.randn(world * args.tokens, moe.hidden, generator=torch.Generator().manual_seed(1)).to(moe.dtype)
    weights = ExpertWeights.random(moe, 0)
    intra, inter = LinkSpec(args.rate).bytes_per_s, LinkSpec(args.inter).bytes_per_s
    hw = replace(cpu_nominal(), link=(LinkEntry(2, intra, intra),), inter_link_bw=inter)
    out = {}
    with Session(RuntimeConfig(transport=TransportKind.DIST, deadline_s=120.0)) as session:
        for mode in MODES:
            tiles = TileSpec(rows=64, gemm_rows=64, gemm_cols=256, dispatch=mode,
                             partial_dtype=torch.bfloat16)
            runner = ForwardRunner(session, weights, ForwardOptions(
                tiles=tiles, policy=SchedulePolicy.CRITICAL_PATH, hardware=hw, cache_schedules=True,
                nodes=par.nodes))
            times = []
            for _ in range(args.repeats + 1):  # the first call schedules and warms up
                t = runner(x[mine], Routing(every.ids[mine], every.weights[mine])).times
                total = t.exchange_s + t.schedule_s + t.prepare_s + t.region_s
                times.append([t.region_s, total])
            slowest = slowest_rank(np.array(times[1:]), None)
            out[mode.value] = {"region_ms": round(float(np.median(slowest[:, 0])) * 1e3, 2),
                               "total_ms": round(float(np.median(slowest[:, 1])) * 1e3, 2)}
    if rank == 0:
        print(json.dumps({"ep": world, "ranks_per_node": args.ranks_per_node, "rate": args.rate,
                          "inter": args.inter, "preset": args.preset, "tokens_per_rank": args.tokens,
                          "repeats": args.repeats, **out}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--rate", default="2gbit")
    ap.add_argument("--inter", default="400mbit")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rank-body", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    record()
    if args.rank_body:
        rank_body(args)
        return
    argv = (sys.executable, os.path.abspath(__file__), "--rank-body", *sys.argv[1:])
    link = LinkSpec(args.rate, inter=args.inter, ranks_per_node=args.ranks_per_node)
    result = launch(LaunchSpec(argv=argv, world=args.ep, link=link, timeout_s=900, capture=True))
    if not result.ok:
        for r in result.ranks:
            print(f"rank {r.rank} exit {r.returncode}\n{r.stderr[-3000:]}", file=sys.stderr)
        sys.exit(1)
    print(result.ranks[0].stdout.strip())


if __name__ == "__main__":
    main()

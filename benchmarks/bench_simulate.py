"""Wall time of lowering + scheduling + simulating every rank (DeepSeek-V3, 4096 tokens
per rank by default) for each policy; the targets are < 5 s at EP 8 and < 60 s at EP 64
for the whole pipeline of the critical-path policy (which simulates its candidates).

    .venv/bin/python benchmarks/bench_simulate.py [--eps 8 64] [--routing balanced]
        [--hardware ascend-a3] [--preset deepseek-v3] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import time

from hpmoe.machine import record
from hpmoe.regions.forward import lower_forward
from hpmoe.routing import RoutingKind, plan_routing, synthetic_routing
from hpmoe.schedule import QUEUE_POLICIES, schedule
from hpmoe.sim.presets import hardware_preset
from hpmoe.sim.simulate import simulate
from hpmoe.spec import ParallelSpec, TileSpec, preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--eps", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--routing", nargs="+", default=[RoutingKind.BALANCED.value])
    ap.add_argument("--hardware", default="ascend-a3")
    args = ap.parse_args()
    record()
    moe, hw = preset(args.preset), hardware_preset(args.hardware)
    print(f"{'ep':>3} {'routing':>8} {'policy':>14} {'tasks':>7} {'lower s':>8} {'schedule s':>10} "
          f"{'simulate s':>10} {'total s':>8} {'makespan us':>12}")
    for routing in map(RoutingKind, args.routing):
        for ep in args.eps:
            par = ParallelSpec(ep=ep, tokens_per_rank=args.tokens)
            plan = plan_routing(synthetic_routing(routing, moe, par, seed=0).ids, moe, par)
            for policy in QUEUE_POLICIES:
                t0 = time.perf_counter()
                graph = lower_forward(plan, TileSpec())
                t1 = time.perf_counter()
                sched = schedule(graph, policy, hw)
                t2 = time.perf_counter()
                span = simulate(sched, hw).makespan
                t3 = time.perf_counter()
                print(f"{ep:>3} {routing.value:>8} {policy.value:>14} {graph.num_tasks:>7} {t1 - t0:>8.2f} "
                      f"{t2 - t1:>10.2f} {t3 - t2:>10.2f} {t3 - t0:>8.2f} {span * 1e6:>12.1f}", flush=True)


if __name__ == "__main__":
    main()

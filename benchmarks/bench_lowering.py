"""Per-step lowering time: routing changes every step, so lowering must be cheap.

Measures plan_routing + one region's lowering (``--region``: the forward, the backward
with the shared activation recomputed, or the rank-deduplicated forward) for one rank's
graph (what each rank does every step) and for all ranks together (what the simulator
needs).

    .venv/bin/python benchmarks/bench_lowering.py [--preset deepseek-v3] [--tokens 4096]
        [--region forward|backward|dedup]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from hpmoe.machine import record
from hpmoe.regions.backward import lower_backward
from hpmoe.regions.dedup import lower_dedup
from hpmoe.regions.forward import lower_forward
from hpmoe.routing import RoutingKind, plan_routing, synthetic_routing
from hpmoe.spec import DispatchMode, ParallelSpec, TileSpec, preset

REGIONS = {"forward": (lower_forward, TileSpec()),
           "backward": (functools.partial(lower_backward, recompute=True), TileSpec()),
           "dedup": (lower_dedup, TileSpec(dispatch=DispatchMode.PER_RANK))}


def _time(fn, repeats: int) -> tuple[float, float]:
    """Median and min seconds over ``repeats`` calls after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), min(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--eps", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--region", choices=list(REGIONS), default="forward")
    args = ap.parse_args()
    record()
    moe, (lower, tiles) = preset(args.preset), REGIONS[args.region]
    print(f"{args.region} lowering, {args.tokens} tokens per rank")
    print(f"{'ep':>4} {'routing':>8} {'plan ms':>8} {'1 rank ms':>10} {'tasks/rank':>10} "
          f"{'all ranks ms':>12} "
          f"{'tasks':>8}")
    for ep in args.eps:
        par = ParallelSpec(ep=ep, tokens_per_rank=args.tokens)
        for kind in (RoutingKind.BALANCED, RoutingKind.ZIPF):
            ids = synthetic_routing(kind, moe, par, seed=0).ids
            plan_s, _ = _time(lambda: plan_routing(ids, moe, par), args.repeats)  # noqa: B023
            plan = plan_routing(ids, moe, par)
            one_s, _ = _time(lambda: lower(plan, tiles, ranks=(0,)), args.repeats)  # noqa: B023
            all_s, _ = _time(lambda: lower(plan, tiles), max(1, args.repeats // 2))  # noqa: B023
            one = lower(plan, tiles, ranks=(0,)).num_tasks
            total = lower(plan, tiles).num_tasks
            print(f"{ep:>4} {kind.value:>8} {plan_s * 1e3:>8.1f} {one_s * 1e3:>10.1f} {one:>10} "
                  f"{all_s * 1e3:>12.0f} {total:>8}", flush=True)


if __name__ == "__main__":
    main()

"""How much of a training step the region's own timing sees, per path: AUTO's tuner
times a call's region (its forward and backward, ``RegionFunction`` and
``RegionFunctionBackward``) and nothing else, so work a path leaves outside it (autograd
copying a gradient something still references, say) is invisible to the choice.  On 2
gloo ranks, per pinned path: training steps of one ``hpmoe.MoE`` (the same steps as
``bench_balance.py``'s plain layer), each under the profiler, which names the region's
two autograd nodes; the slowest rank's step, its region and the rest, ms, median of
``--iters``.

    .venv/bin/python benchmarks/region_share.py [--preset mixtral-8x7b --hidden 1024 --ffn 3584] \\
        [--tokens 1024] [--routing hot] [--iters 8] [--paths kernel_by_kernel,taskflow]
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench_balance import PATHS, _step, rank_inputs
from torch.profiler import ProfilerActivity, profile

from hpmoe.machine import record
from hpmoe.routing import RoutingKind
from hpmoe.testing import spawn_gloo

REGION = ("RegionFunction", "RegionFunctionBackward")


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per path: each step's seconds, and its region's (forward and backward nodes)."""
    import torch.distributed as dist

    from hpmoe import MoE

    me = rank_inputs(rank, world, args)
    out = {}
    for path in args.paths.split(","):
        layer = MoE(me.spec, me.weights, ep_group=dist.group.WORLD, **PATHS[path])
        for _ in range(args.warmup):
            _step(layer, me.ids, me, args)
        step, region = [], []
        for _ in range(args.iters):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                seconds, _ = _step(layer, me.ids, me, args)
            step.append(seconds)
            region.append(sum(e.cpu_time_total for e in prof.key_averages() if e.key in REGION) / 1e6)
        layer.close()
        out[path] = {"step": step, "region": region}
    return out


def _figures(ranks: list[dict]) -> dict[str, dict[str, float]]:
    """Per path: median ms of the slowest rank's step, its region and the rest."""
    out = {}
    for path in ranks[0]:
        step = [max(t) for t in zip(*(r[path]["step"] for r in ranks), strict=True)]
        region = [max(t) for t in zip(*(r[path]["region"] for r in ranks), strict=True)]
        rest = [s - g for s, g in zip(step, region, strict=True)]
        out[path] = {name: round(statistics.median(v) * 1e3, 1)
                     for name, v in (("step_ms", step), ("region_ms", region), ("outside_ms", rest))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="mixtral-8x7b")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=3584)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--routing", default="hot", choices=[k.value for k in RoutingKind])
    p.add_argument("--paths", default="kernel_by_kernel,taskflow")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    if any(path not in PATHS or path == "auto" for path in args.paths.split(",")):
        p.error(f"--paths={args.paths!r}: a comma-separated list of pinned paths, of "
                f"{sorted(set(PATHS) - {'auto'})}")
    args.forward_only, args.sync, args.shard = False, False, False  # bench_balance's _step reads them
    record()
    ranks = spawn_gloo(_rank, 2, args, timeout=3600)
    print(json.dumps({"args": vars(args), "paths": _figures(ranks)}))


if __name__ == "__main__":
    main()

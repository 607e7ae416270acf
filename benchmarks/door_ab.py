"""What the front door costs a small call: an AUTO layer (settled on its tuned path),
a layer pinned to kernel by kernel, the kernel-by-kernel executor called bare on the
session's collectives (no agreement, no layer) and the serialized baseline
(``refs.serialized_ep_forward``: raw all-to-alls), alternating call by call on 2 gloo
ranks over a shared-memory session; the collectives one call makes, and what one small
gloo all-gather takes between these ranks.

    HPMOE_PROFILE=/nonexistent .venv/bin/python benchmarks/door_ab.py \
        [--preset tiny] [--tokens 256] [--calls 400]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch

from hpmoe.machine import record
from hpmoe.testing import spawn_gloo

SETTLE = 120  # calls of the AUTO layer before timing: its tuning ends well within


def _ms(seconds: list[float]) -> dict[str, float]:
    v = np.array(seconds) * 1e3
    return {"min_ms": float(v.min()), "p10_ms": float(np.percentile(v, 10)), "median_ms": float(np.median(v))}


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    from hpmoe import MoE
    from hpmoe.exec.arena import ArenaPool
    from hpmoe.exec.kernel_by_kernel import kbk_forward
    from hpmoe.refs import serialized_ep_forward
    from hpmoe.routing import Routing, RoutingKind, synthetic_routing
    from hpmoe.runtime import Session
    from hpmoe.spec import ParallelSpec, preset
    from hpmoe.weights import ExpertWeights

    spec = preset(args.preset, torch.float32)
    par = ParallelSpec(ep=world, tokens_per_rank=args.tokens)
    r = synthetic_routing(RoutingKind.BALANCED, spec, par, seed=0)
    mine = slice(rank * args.tokens, (rank + 1) * args.tokens)
    ids, topk = r.ids[mine].contiguous(), r.weights[mine].contiguous()
    x = torch.randn(args.tokens, spec.hidden, generator=torch.Generator().manual_seed(rank))
    w = ExpertWeights.random(spec, seed=0)
    with torch.no_grad(), Session(group=None) as s:
        layers = {"auto": MoE(spec, w, ep_group=s), "kernel_by_kernel": MoE(spec, w, ep_group=s,
                                                                            backend="kernel_by_kernel")}
        for _ in range(SETTLE):
            layers["auto"].region(x, ids, topk)
        tuned = layers["auto"].tuned(args.tokens, backward=False)
        routing, pool = Routing(ids, topk), ArenaPool()
        calls = {name: (lambda m=m: m.region(x, ids, topk)) for name, m in layers.items()}
        calls |= {"bare_kernel_by_kernel": lambda: kbk_forward(x, routing, w, s.collectives, pool),
                  "serialized_baseline": lambda: serialized_ep_forward(x, w, routing)}
        seconds: dict[str, list[float]] = {n: [] for n in calls}
        names = list(calls)
        for i in range(args.calls):
            for name in names[i % len(names):] + names[:i % len(names)]:  # each first in turn
                s.collectives.barrier("door_ab", publish=False)
                t0 = time.perf_counter()
                calls[name]()
                seconds[name].append(time.perf_counter() - t0)
        waits = _count_waits(lambda: layers["kernel_by_kernel"].region(x, ids, topk))
        gather = _all_gather_seconds(args.calls)
    return {"seconds": seconds, "tuned": tuned.describe() if tuned else None, "waits_per_call": waits,
            "all_gather": gather}


def _count_waits(call) -> float:
    """Collectives one call waits on (``Work.wait`` calls, averaged over 20 calls)."""
    import torch.distributed as dist

    real, count = dist.Work.wait, [0]

    def counted(self, *a, **k):
        count[0] += 1
        return real(self, *a, **k)

    dist.Work.wait = counted
    try:
        for _ in range(20):
            call()
    finally:
        dist.Work.wait = real
    return count[0] / 20


def _all_gather_seconds(n: int) -> list[float]:
    import torch.distributed as dist

    t = torch.zeros(64, dtype=torch.int64)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    out = []
    for _ in range(n + 50):
        t0 = time.perf_counter()
        dist.all_gather(parts, t)
        out.append(time.perf_counter() - t0)
    return out[50:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--calls", type=int, default=400)
    args = p.parse_args()
    record()
    with tempfile.TemporaryDirectory() as tmp:  # an empty tuning cache: the AUTO layer tunes
        os.environ["HPMOE_TUNE_CACHE"] = f"{tmp}/tune.json"
        ranks = spawn_gloo(_rank, 2, args, timeout=1800)
    r0 = ranks[0]
    print(json.dumps({"args": vars(args), "auto_tuned": r0["tuned"],
                      "calls": {n: _ms(v) for n, v in r0["seconds"].items()},
                      "collectives_per_call": r0["waits_per_call"],
                      "gloo_all_gather_64_int64": _ms(r0["all_gather"])}))


if __name__ == "__main__":
    main()

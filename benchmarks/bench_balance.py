"""What a user's balanced layer gains: training steps (forward + backward) of
``hpmoe.MoE`` on 2 gloo ranks under skewed routing, the plain layer against the same
layer after ``layer.rebalance(redundant)`` (its own measured load, its own per-call
gather of this rank's slots), alternating call by call after a barrier; the slowest
rank's time per step.  This is the path ``rebalance`` and ``rebalance_every`` give; a
third layer, ``prepared``, is the same placement as a physical layer built once (what
``hpmoe bench --balance`` times), so the difference is the balanced layer's per-call
gather.  ``--shard``: both layers store only their own slots (``shard_experts``; the
balanced one holds ``redundant`` extra slots and its rebalance moves rows), and there
is no prepared layer.

    HPMOE_PROFILE=/nonexistent .venv/bin/python benchmarks/bench_balance.py \
        [--preset small] [--hidden H --ffn F] [--tokens 1024] [--routing hot] \
        [--redundant 2] [--iters 30] [--backend exact|kernel_by_kernel] [--forward-only] [--shard] \
        [--sync]

``--hidden``/``--ffn`` scale a preset's width (its routing kept: experts, top-k,
shared experts), e.g. Mixtral's top-2 of 8 at a quarter of its width on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

import torch

from hpmoe.bench.order import iteration_order
from hpmoe.machine import record
from hpmoe.routing import RoutingKind
from hpmoe.testing import spawn_gloo


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from hpmoe import MoE
    from hpmoe.routing import synthetic_routing
    from hpmoe.spec import ParallelSpec, preset
    from hpmoe.weights import ExpertWeights

    torch.set_num_threads(1)
    spec = preset(args.preset, torch.float32)
    spec = dataclasses.replace(spec, hidden=args.hidden or spec.hidden, ffn=args.ffn or spec.ffn)
    par = ParallelSpec(ep=world, tokens_per_rank=args.tokens)
    r = synthetic_routing(RoutingKind(args.routing), spec, par, seed=0)
    mine = slice(rank * args.tokens, (rank + 1) * args.tokens)
    ids, topk = r.ids[mine].contiguous(), r.weights[mine].contiguous()
    g = torch.Generator().manual_seed(rank)
    x, dy = (torch.randn(args.tokens, spec.hidden, generator=g) for _ in range(2))
    w = ExpertWeights.random(spec, seed=0)
    shard = {"shard_experts": True} if args.shard else {}
    layers = {"plain": MoE(spec, w, ep_group=dist.group.WORLD, backend=args.backend, **shard),
              "balanced": MoE(spec, w, ep_group=dist.group.WORLD, backend=args.backend,
                              redundant=args.redundant if args.shard else 0, **shard)}
    routed = dict.fromkeys(layers, ids)
    backward = not args.forward_only

    def step(name: str) -> tuple[float, torch.Tensor]:
        layer = layers[name]
        dist.barrier()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(backward):
            xg = x.clone().requires_grad_(backward)
            out = layer.region(xg, routed[name], topk.clone().requires_grad_(backward))
            if backward:
                out.backward(dy)
        if args.sync and not args.shard:  # expert gradients all-reduced, as DDP would
            for p in layer.experts.parameters():
                dist.all_reduce(p.grad)
                p.grad = None
        return time.perf_counter() - t0, out.detach()

    for _ in range(3):
        step("balanced")  # its measured load
    placement = layers["balanced"].rebalance(args.redundant)
    if placement is not None and not args.shard:  # the placement as a physical layer built once
        tokens = torch.arange(args.tokens) + rank * args.tokens
        routed["prepared"] = placement.physical_ids(ids, torch.full_like(tokens, rank), tokens)
        pw = placement.physical_weights(w)
        layers["prepared"] = MoE(pw.spec, pw, ep_group=dist.group.WORLD, backend=args.backend)
    for name, layer in layers.items():  # warm-up, and AUTO's tuning to its end
        for call in range(args.warmup + 200):
            step(name)
            settled = args.backend != "exact" or layer.tuned(args.tokens, backward=backward) is not None
            if settled and call + 1 >= args.warmup:
                break
    seconds: dict[str, list[float]] = {n: [] for n in layers}
    outs = {}
    for i in range(args.iters):
        for name in iteration_order(list(layers), i):
            s, outs[name] = step(name)
            seconds[name].append(s)
    tuned = {n: layer.tuned(args.tokens, backward=backward) for n, layer in layers.items()}
    chosen = {n: t.winner.name if t else args.backend for n, t in tuned.items()}
    for layer in layers.values():
        layer.close()
    return {"seconds": seconds, "diff": max((outs["plain"] - o).abs().max().item() for o in outs.values()),
            "placement": None if placement is None else list(placement.phy2log), "chosen": chosen}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--hidden", type=int, default=0, help="the preset's hidden size (0: as it is)")
    p.add_argument("--ffn", type=int, default=0, help="the preset's expert FFN size (0: as it is)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--routing", default="hot", choices=[k.value for k in RoutingKind])
    p.add_argument("--redundant", type=int, default=2)
    p.add_argument("--backend", default="exact", choices=["exact", "kernel_by_kernel"],
                   help="exact: AUTO's choice, tuned before timing (the default layer)")
    p.add_argument("--shard", action="store_true",
                   help="layers that store only their own slots (shard_experts): the balanced one moves rows")
    p.add_argument("--sync", action="store_true",
                   help="each step also all-reduces the expert gradients where every rank keeps every "
                        "expert (as DDP would); a --shard layer summed its replicas' in its backward")
    p.add_argument("--forward-only", action="store_true",
                   help="time forward calls (no_grad), not training steps")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    record()
    with tempfile.TemporaryDirectory() as tmp:  # an empty tuning cache: each layer tunes
        os.environ["HPMOE_TUNE_CACHE"] = f"{tmp}/tune.json"
        ranks = spawn_gloo(_rank, 2, args, timeout=3600)
    figures = {}
    for name in ranks[0]["seconds"]:
        slowest = [max(t) for t in zip(*(r["seconds"][name] for r in ranks), strict=True)]
        figures[name] = {"median_ms": statistics.median(slowest) * 1e3, "min_ms": min(slowest) * 1e3}
    gain = {"median": figures["plain"]["median_ms"] / figures["balanced"]["median_ms"],
            "fastest": figures["plain"]["min_ms"] / figures["balanced"]["min_ms"]}
    print(json.dumps({"args": vars(args), "placement": ranks[0]["placement"], "chosen": ranks[0]["chosen"],
                      "max_abs_diff": max(r["diff"] for r in ranks), "steps": figures, "gain": gain}))


if __name__ == "__main__":
    main()

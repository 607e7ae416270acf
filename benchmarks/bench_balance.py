"""What a user's balanced layer gains, on each path: training steps (forward +
backward) of ``hpmoe.MoE`` on 2 gloo ranks under skewed routing.  Per path (``--paths``:
kernel by kernel pinned, the taskflow pinned to hyperparallel on the layer's default
workers, and AUTO, tuned to its end before timing) three layers: ``plain``; ``balanced``,
the same layer after ``layer.rebalance(redundant)`` (its own measured load; its slots
read their experts' rows in place); and ``prepared``, the same placement as a physical
layer built once (what ``hpmoe bench --balance`` times), so balanced against prepared is
what balancing a live layer costs on that path.  The paths run one after another (one
path's layers in memory at a time); a path's layers alternate call by call after a
barrier (``iteration_order``), their expert gradients dropped after each step as an
optimizer's ``zero_grad`` does; the slowest rank's time per step.  ``ideal``:
the busiest rank's routed rows without the placement over with it (each token on its
replica, the shared experts' rows counted at their width), the most balancing can gain.
``--shard``: the layers store only their own slots (``shard_experts``; the balanced one
holds ``redundant`` extra slots and its rebalance moves rows), and there is no prepared
layer.

    HPMOE_PROFILE=/nonexistent .venv/bin/python benchmarks/bench_balance.py \\
        [--preset small] [--hidden H --ffn F] [--tokens 1024] [--routing hot] \\
        [--redundant 2] [--iters 30] [--paths auto,kernel_by_kernel,taskflow] [--forward-only] \\
        [--shard] [--sync]

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

import numpy as np
import torch

from hpmoe.bench.order import iteration_order
from hpmoe.ir.schedule import SchedulePolicy
from hpmoe.machine import record
from hpmoe.routing import RoutingKind
from hpmoe.testing import spawn_gloo

PATHS = {"auto": {}, "kernel_by_kernel": {"backend": "kernel_by_kernel"},
         "taskflow": {"schedule": SchedulePolicy.HYPERPARALLEL}}
ROLES = ("plain", "balanced", "prepared")


def _spec(args: argparse.Namespace):
    from hpmoe.spec import preset

    spec = preset(args.preset, torch.float32)
    return dataclasses.replace(spec, hidden=args.hidden or spec.hidden, ffn=args.ffn or spec.ffn)


def _routing(args: argparse.Namespace, spec, world: int):
    from hpmoe.routing import synthetic_routing
    from hpmoe.spec import ParallelSpec

    par = ParallelSpec(ep=world, tokens_per_rank=args.tokens)
    return synthetic_routing(RoutingKind(args.routing), spec, par, seed=0)


@dataclasses.dataclass
class Rank:
    """One rank's inputs: its tokens x and output gradient dy [T, H], routing ids and
    weights [T, k], and the layer's logical weights."""

    rank: int
    spec: object
    weights: object
    x: torch.Tensor
    dy: torch.Tensor
    ids: torch.Tensor
    topk: torch.Tensor


def rank_inputs(rank: int, world: int, args: argparse.Namespace) -> Rank:
    """Rank ``rank``'s tokens, output gradient and routing of ``args``' layer, whose
    weights every rank makes alike; torch on one thread."""
    from hpmoe.weights import ExpertWeights

    torch.set_num_threads(1)
    spec = _spec(args)
    r = _routing(args, spec, world)
    mine = slice(rank * args.tokens, (rank + 1) * args.tokens)
    g = torch.Generator().manual_seed(rank)
    x, dy = (torch.randn(args.tokens, spec.hidden, generator=g) for _ in range(2))
    return Rank(rank, spec, ExpertWeights.random(spec, seed=0), x, dy, r.ids[mine].contiguous(),
                r.weights[mine].contiguous())


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    """Each path's three layers, timed path after path (one path's layers alive at a
    time: nine full-size layers do not fit a small host's memory)."""
    me = rank_inputs(rank, world, args)
    out: dict = {"seconds": {}, "placements": {}, "chosen": {}, "tuned": {}, "diff": 0.0}
    first = None
    for path in args.paths.split(","):
        timed = _time_path(path, me, args)
        last = timed.pop("out")
        first = last if first is None else first
        out["diff"] = max(out["diff"], (first - last).abs().max().item())
        for name, value in timed.items():
            out[name] |= value
    return out


def _time_path(path: str, me: Rank, args: argparse.Namespace) -> dict:
    """The plain, balanced and prepared layers of ``path``: warmed up (AUTO tuned to its
    end), then ``args.iters`` steps each, alternating call by call."""
    layers, routed, placement = _layers(path, me, args)
    backward = not args.forward_only
    for name, layer in layers.items():  # warm-up, and AUTO's tuning to its end
        for call in range(args.warmup + 200):
            _step(layer, routed[name], me, args)
            settled = path != "auto" or layer.tuned(args.tokens, backward=backward) is not None
            if settled and call + 1 >= args.warmup:
                break
    seconds: dict[str, list[float]] = {n: [] for n in layers}
    for i in range(args.iters):
        for name in iteration_order(list(layers), i):
            s, out = _step(layers[name], routed[name], me, args)
            seconds[name].append(s)
    chosen = {n: _ran(n, layer, args.tokens, backward) for n, layer in layers.items()}
    tuned = {n: t.describe() for n, layer in layers.items()
             if (t := layer.tuned(args.tokens, backward=backward)) is not None}
    for layer in layers.values():
        layer.close()
    return {"seconds": seconds, "placements": {path: None if placement is None else list(placement.phy2log)},
            "chosen": chosen, "tuned": tuned, "out": out}


def _layers(path: str, me: Rank, args: argparse.Namespace) -> tuple[dict, dict, object]:
    """``path``'s layers and the routing ids each is called with: plain, balanced (its own
    load measured over three steps, then ``rebalance``) and, unless sharded, the balanced
    placement as a physical layer built once."""
    import torch.distributed as dist

    from hpmoe import MoE

    group = dist.group.WORLD
    shard = {"shard_experts": True} if args.shard else {}
    extra = {"redundant": args.redundant} if args.shard else {}  # sharded: its slots stored from the start
    plain = MoE(me.spec, me.weights, ep_group=group, **PATHS[path], **shard)
    balanced = MoE(me.spec, me.weights, ep_group=group, **PATHS[path], **shard, **extra)
    for _ in range(3):
        _step(balanced, me.ids, me, args)  # its measured load
    placement = balanced.rebalance(args.redundant)
    layers, routed = {f"{path}:plain": plain, f"{path}:balanced": balanced}, {}
    if placement is not None and not args.shard:
        tokens = torch.arange(args.tokens) + me.rank * args.tokens
        routed[f"{path}:prepared"] = placement.physical_ids(me.ids, torch.full_like(tokens, me.rank), tokens)
        pw = placement.physical_weights(me.weights)
        layers[f"{path}:prepared"] = MoE(pw.spec, pw, ep_group=group, **PATHS[path])
    return layers, {n: routed.get(n, me.ids) for n in layers}, placement


def _step(layer, ids: torch.Tensor, me: Rank, args: argparse.Namespace) -> tuple[float, torch.Tensor]:
    """One call (forward and backward unless ``--forward-only``) after a barrier: its
    seconds and output.  Expert gradients are dropped after it (``zero_grad``), as a
    training step's optimizer does, or first all-reduced (``--sync``, as DDP would)."""
    import torch.distributed as dist

    backward = not args.forward_only
    dist.barrier()
    t0 = time.perf_counter()
    with torch.set_grad_enabled(backward):
        xg = me.x.clone().requires_grad_(backward)
        out = layer.region(xg, ids, me.topk.clone().requires_grad_(backward))
        if backward:
            out.backward(me.dy)
    if args.sync and not args.shard:
        for p in layer.experts.parameters():
            dist.all_reduce(p.grad)
    seconds = time.perf_counter() - t0
    layer.zero_grad(set_to_none=True)
    return seconds, out.detach()


def _ran(name: str, layer, tokens: int, backward: bool) -> str:
    """What layer ``name`` ran: AUTO's settled winner, else its pinned path."""
    tuned = layer.tuned(tokens, backward=backward)
    return tuned.winner.name if tuned is not None else name.split(":")[0]


def ideal_gain(args: argparse.Namespace, phy2log: list[int] | None, world: int = 2) -> dict:
    """The busiest rank's routed rows without and with the placement (each token on the
    replica ``Placement.physical_ids`` gives it; shared experts' rows at their width, equal
    on every rank) and their ratio: what balancing can gain at most."""
    from hpmoe.placement import Placement

    spec = _spec(args)
    ids = _routing(args, spec, world).ids
    tokens = torch.arange(ids.shape[0])
    shared = args.tokens * spec.shared_ffn / spec.ffn

    def rows(p: Placement) -> np.ndarray:
        slots = p.physical_ids(ids, tokens // args.tokens, tokens).flatten().numpy()
        return np.bincount(p.slot_rank()[slots], minlength=world) + shared

    before = rows(Placement.identity(spec.experts, world))
    after = rows(Placement(tuple(phy2log), spec.experts, world)) if phy2log else before
    return {"rank_rows": {"plain": before.tolist(), "balanced": after.tolist()},
            "ideal": float(before.max() / after.max())}


def _figures(ranks: list[dict]) -> dict[str, dict[str, float]]:
    """Per layer: median and fastest of the slowest rank's step, ms."""
    out = {}
    for name in ranks[0]["seconds"]:
        slowest = [max(t) for t in zip(*(r["seconds"][name] for r in ranks), strict=True)]
        out[name] = {"median_ms": statistics.median(slowest) * 1e3, "min_ms": min(slowest) * 1e3}
    return out


def _ratio(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {"median": a["median_ms"] / b["median_ms"], "fastest": a["min_ms"] / b["min_ms"]}


def _per_path(figures: dict[str, dict[str, float]], paths: list[str]) -> dict[str, dict]:
    """Per path: the balanced layer's gain over the plain one, the prepared layer's, and
    the balanced layer's step over the prepared one's (1.0: balancing a live layer costs
    nothing more)."""
    out = {}
    for path in paths:
        f = {role: figures.get(f"{path}:{role}") for role in ROLES}
        out[path] = {"gain": _ratio(f["plain"], f["balanced"])}
        if f["prepared"] is not None:
            out[path] |= {"prepared_gain": _ratio(f["plain"], f["prepared"]),
                          "balanced_over_prepared": _ratio(f["balanced"], f["prepared"])}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--hidden", type=int, default=0, help="the preset's hidden size (0: as it is)")
    p.add_argument("--ffn", type=int, default=0, help="the preset's expert FFN size (0: as it is)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--routing", default="hot", choices=[k.value for k in RoutingKind])
    p.add_argument("--redundant", type=int, default=2)
    p.add_argument("--paths", default="auto,kernel_by_kernel,taskflow",
                   help=f"comma-separated, of {sorted(PATHS)}: auto is AUTO's choice, tuned before timing")
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
    paths = args.paths.split(",")
    if not paths or any(path not in PATHS for path in paths):
        p.error(f"--paths={args.paths!r}: a comma-separated list of {sorted(PATHS)}")
    record()
    with tempfile.TemporaryDirectory() as tmp:  # an empty tuning cache: each layer tunes
        os.environ["HPMOE_TUNE_CACHE"] = f"{tmp}/tune.json"
        ranks = spawn_gloo(_rank, 2, args, timeout=7200)
    figures = _figures(ranks)
    placement = ranks[0]["placements"][paths[0]]
    print(json.dumps({"args": vars(args), "placements": ranks[0]["placements"], **ideal_gain(args, placement),
                      "chosen": ranks[0]["chosen"], "tuned": ranks[0]["tuned"],
                      "max_abs_diff": max(r["diff"] for r in ranks),
                      "steps": figures, "paths": _per_path(figures, paths)}))


if __name__ == "__main__":
    main()

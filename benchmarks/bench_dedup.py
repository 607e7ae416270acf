"""Per-expert against rank-deduplicated dispatch: link bytes, dedup factor and the
simulated Dispatch-to-Combine makespan of the taskflow and of the kernel-by-kernel
(serial) schedule of each graph, under DeepSeek-V3 group-limited routing.

    .venv/bin/python benchmarks/bench_dedup.py [--hardware ascend-a3 h100] [--eps 8 16 32 64]
        [--tokens 4096] [--preset deepseek-v3] [--json]

Routing: i.i.d. uniform scores through the gate's group mask (top ``top_groups`` of
``groups`` groups, then top-k), as DeepSeek-V3's router chooses.  The serial schedule
of the per-rank graph is the deduplicated kernel-by-kernel baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import torch

from hpmoe.machine import record
from hpmoe.regions import RegionKind, region
from hpmoe.regions.dedup_layout import dedup_factor
from hpmoe.routing import _mask_groups, plan_routing
from hpmoe.schedule import SchedulePolicy, schedule
from hpmoe.sim.presets import hardware_preset
from hpmoe.sim.simulate import simulate
from hpmoe.spec import DispatchMode, ParallelSpec, TileSpec, preset


def grouped_ids(moe, n: int, seed: int) -> torch.Tensor:
    """[n, k] expert ids: group-limited top-k of i.i.d. uniform scores."""
    scores = torch.rand(n, moe.experts, generator=torch.Generator().manual_seed(seed))
    return torch.topk(_mask_groups(scores, moe), moe.top_k, dim=-1).indices


def ranks_per_token(ids: torch.Tensor, local: int) -> float:
    owner = (ids // local).sort(dim=1).values
    return float(((owner.diff(dim=1) != 0).sum(dim=1) + 1).double().mean())


def row(moe, ep: int, tokens: int, hw_name: str, seed: int) -> dict:
    par = ParallelSpec(ep=ep, tokens_per_rank=tokens)
    ids = grouped_ids(moe, ep * tokens, seed)
    plan = plan_routing(ids, moe, par)
    hw = hardware_preset(hw_name)
    out = {"hardware": hw_name, "ep": ep, "tokens_per_rank": tokens,
           "ranks_per_token": round(ranks_per_token(ids, par.local_experts(moe)), 3),
           "dedup_factor": round(dedup_factor(plan), 4)}
    variants = {"per-expert": (RegionKind.FORWARD, TileSpec()),
                "per-rank-bf16": (RegionKind.FORWARD_DEDUP,
                                  TileSpec(dispatch=DispatchMode.PER_RANK, partial_dtype=torch.bfloat16)),
                "per-rank-fp32": (RegionKind.FORWARD_DEDUP, TileSpec(dispatch=DispatchMode.PER_RANK))}
    for name, (kind, tiles) in variants.items():
        graph = region(kind).lower(plan, tiles, None)
        link = np.bincount(graph.rank, weights=graph.link_bytes, minlength=ep)
        out[f"{name}_link_MB_max"] = round(float(link.max()) / 1e6, 3)
        out[f"{name}_link_MB_mean"] = round(float(link.mean()) / 1e6, 3)
        policies = (SchedulePolicy.CRITICAL_PATH,) if name == "per-rank-fp32" else \
            (SchedulePolicy.SERIAL, SchedulePolicy.CRITICAL_PATH)
        for policy in policies:
            span = simulate(schedule(graph, policy, hw), hw).makespan
            out[f"{name}_{policy.value}_us"] = round(span * 1e6, 1)
    base = out["per-rank-bf16_serial_us"]
    out["speedup_over_dedup_serial"] = round(base / min(out["per-rank-bf16_critical-path_us"],
                                                        out["per-expert_critical-path_us"]), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--hardware", nargs="+", default=["ascend-a3", "h100"])
    ap.add_argument("--eps", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    record()
    moe = dataclasses.replace(preset(args.preset))
    for hw in args.hardware:
        for ep in args.eps:
            r = row(moe, ep, args.tokens, hw, args.seed)
            print(json.dumps(r) if args.json else "  ".join(f"{k}={v}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()

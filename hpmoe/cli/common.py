"""Arguments shared by several subcommands: the layer, its EP layout and routing."""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import dataclass

import torch

from ..machine import default_cpu_dtype
from ..placement import Placement, place_on_load
from ..routing import Routing, RoutingKind, RoutingPlan, plan_routing, ranks_per_token, synthetic_routing
from ..spec import PRESETS, DispatchMode, MoESpec, ParallelSpec, TileSpec, preset

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
AUTO = "auto"


def add_layer_args(p: argparse.ArgumentParser, tokens: int = 4096, ep: int = 8) -> None:
    p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS), help="MoE shape")
    p.add_argument("--ep", type=int, default=ep, help="expert-parallel ranks")
    p.add_argument("--nodes", type=int, default=1,
                   help="nodes the EP ranks span (ep / nodes ranks each; two link tiers)")
    p.add_argument("--tokens", type=int, default=tokens, help="tokens per rank")
    p.add_argument("--routing", default=RoutingKind.BALANCED.value,
                   choices=[k.value for k in RoutingKind], help="synthetic routing pattern")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *sorted(DTYPES)],
                   help="activations and expert weights; auto: bf16 on a modelled accelerator and "
                        "where this CPU computes bf16 natively, else fp32")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic routing and inputs")
    p.add_argument("--tile-rows", type=int, default=128, help="rows per vector tile")
    p.add_argument("--gemm-rows", type=int, default=128, help="rows per GEMM tile (0: whole expert)")
    p.add_argument("--gemm-cols", type=int, default=512, help="columns per GEMM tile")
    p.add_argument("--dispatch", default=DispatchMode.PER_EXPERT.value,
                   choices=[m.value for m in DispatchMode],
                   help="one dispatch row per (token, expert), per (token, destination rank), or "
                        "per-node: per (token, node) between nodes through a relay (--nodes)")
    p.add_argument("--partial-dtype", default="fp32", choices=sorted(DTYPES),
                   help="wire dtype of the per-rank partial sums (--dispatch per-rank, per-node)")
    p.add_argument("--balance", default="none", metavar="none|migrate|replicate:R",
                   help="expert placement planned on the routing's own per-expert load (hpmoe.placement): "
                        "migrate re-packs the experts onto ranks, replicate:R also adds R replicas of the "
                        "most loaded ones")
    p.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(frozen=True)
class Layer:
    """What the layer arguments describe; with a placement, ``moe`` and ``plan`` are the
    physical layer's (one expert per slot)."""

    moe: MoESpec
    par: ParallelSpec
    tiles: TileSpec
    routing: RoutingKind
    plan: RoutingPlan
    ranks_per_token: float  # mean distinct ranks a token's top-k experts live on
    placement: Placement | None = None


def balance_redundant(text: str) -> int | None:
    """``--balance``: None (no placement), or the redundant slots (0 for ``migrate``)."""
    if text == "none":
        return None
    if text == "migrate":
        return 0
    kind, _, count = text.partition(":")
    if kind != "replicate" or not count.isdigit() or int(count) <= 0:
        raise ValueError(f"--balance={text!r} must be none, migrate or replicate:R with R > 0")
    return int(count)


def placed(text: str, routing: Routing, moe: MoESpec,
           par: ParallelSpec) -> tuple[Routing, MoESpec, Placement | None]:
    """The routing and layer the region computes under ``--balance`` (``place_on_load``)."""
    redundant = balance_redundant(text)
    if redundant is None:
        return routing, moe, None
    return place_on_load(routing, moe, par, redundant)


def dtype_choice(name: str, on_this_cpu: bool) -> tuple[str, str | None]:
    """``--dtype`` with ``auto`` resolved: on a modelled accelerator bf16, on this CPU
    what it computes natively.  (name, why) where auto chose on this CPU, else (name, None)."""
    if name != AUTO:
        return name, None
    if not on_this_cpu:
        return "bf16", None
    dtype, why = default_cpu_dtype()
    return next(n for n, d in DTYPES.items() if d == dtype), why


def layer_from_args(args: argparse.Namespace) -> Layer:
    dtype, _ = dtype_choice(args.dtype, on_this_cpu=getattr(args, "hardware", None) == "cpu")
    moe = preset(args.preset, DTYPES[dtype])
    par = ParallelSpec(ep=args.ep, tokens_per_rank=args.tokens, nodes=args.nodes)
    par.local_experts(moe)
    kind = RoutingKind(args.routing)
    drawn = synthetic_routing(kind, moe, par, seed=args.seed)
    routing, moe, placement = placed(getattr(args, "balance", "none"), drawn, moe, par)
    tiles = TileSpec(rows=args.tile_rows, gemm_rows=args.gemm_rows, gemm_cols=args.gemm_cols,
                     dispatch=DispatchMode(getattr(args, "dispatch", DispatchMode.PER_EXPERT.value)),
                     partial_dtype=DTYPES[getattr(args, "partial_dtype", "fp32")])
    return Layer(moe=moe, par=par, tiles=tiles, routing=kind, plan=plan_routing(routing.ids, moe, par),
                 ranks_per_token=ranks_per_token(routing.ids, moe, par), placement=placement)


def require_plotting(what: str) -> None:
    """ModuleNotFoundError (one line, with the fix) unless matplotlib is installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ModuleNotFoundError(f"{what} needs matplotlib, which is not installed: "
                                  "pip install 'hpmoe[plot]' (or make demo / make test, which install it)")


def emit(obj: dict, as_json: bool) -> None:
    """Print ``obj`` as JSON or as aligned ``key: value`` lines."""
    if as_json:
        print(json.dumps(obj, indent=None, sort_keys=False))
        return
    width = max(map(len, obj), default=0)
    for key, value in obj.items():
        print(f"{key:<{width}}  {value}")

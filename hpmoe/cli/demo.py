"""``hpmoe demo``: a small DeepSeek-style MoE layer, end to end, on this CPU."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .. import refs
from ..execute import execute_forward
from ..routing import route
from ..spec import preset
from ..weights import ExpertWeights
from .info import graph_summary


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run a small DeepSeek-style layer end to end")
    p.add_argument("--out", type=Path, default=Path("out"), help="directory for traces and plots")
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.set_defaults(run=run)


def _section(title: str) -> None:
    print(f"\n== {title}")


def exact_forward(ep: int, tokens: int) -> None:
    """Route with the DeepSeek-V3 gate, run the tile graph on virtual ranks, compare."""
    spec = preset("small", torch.bfloat16)
    _section(f"forward taskflow: preset 'small' ({spec.experts} experts, top-{spec.top_k}, "
             f"H {spec.hidden}, F {spec.ffn}, shared {spec.shared_experts}), EP {ep}, "
             f"{tokens} tok/rank, bf16")
    weights = ExpertWeights.random(spec, seed=0)
    x = torch.randn(ep * tokens, spec.hidden, generator=torch.Generator().manual_seed(1)).to(spec.dtype)
    routing = route(x, weights)
    start = time.perf_counter()
    result = execute_forward(x, weights, routing, ep)
    elapsed = time.perf_counter() - start
    ref = refs.dense_moe(x, routing, weights)
    summary = graph_summary(result.graph)
    print(f"tasks {summary['tasks']} ({summary['tasks_per_unit']}), events {summary['events']}")
    print(f"exact executor: {elapsed * 1e3:.0f} ms; max |taskflow - dense reference| = "
          f"{(result.out.float() - ref.float()).abs().max().item():.3g} (bf16)")
    again = execute_forward(x, weights, routing, ep, order=7).out
    print(f"another valid task order gives the same bits: {torch.equal(again, result.out)}")


def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    exact_forward(args.ep, args.tokens)
    return 0

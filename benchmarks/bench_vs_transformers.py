"""One-process step time of an MoE block: ``hpmoe.MoE`` as a user gets it (default
schedule: AUTO) against transformers' own block with its ``eager`` and ``grouped_mm``
experts implementations, on the very same parameters (``MoE.from_hf`` shares them).

Cases: the ``small`` preset as a transformers ``DeepseekV3MoE`` block, and a
Qwen3-30B-A3B-like ``Qwen3MoeSparseMoeBlock`` (H 2048, F 768, 128 experts, top-8);
forward and forward+backward; fp32 and bf16.  Each case times ``--rounds`` rounds of the
three variants after one untimed warm-up round, in balanced orders (each variant runs
right after each other one equally often over 6 rounds).  Reported per case:
median ms of each variant, ``ratio`` = best transformers median / hpmoe median (>= 1:
hpmoe is faster), and the noise: the lowest and highest per-round ratio (best
transformers time / hpmoe time in the same round).

    flock /tmp/hpmoe-bench.lock .venv/bin/python benchmarks/bench_vs_transformers.py \
        [--cases small,qwen3] [--small-tokens 4096] [--qwen-tokens 2048] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from hpmoe.bench.order import iteration_order
from hpmoe.machine import record
from hpmoe.nn.hf import randomize_moe_, tiny_deepseek_v3_config, tiny_qwen3_moe_config
from hpmoe.nn.layer import MoE

IMPLS = ("eager", "grouped_mm")


def small_block(dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = tiny_deepseek_v3_config(hidden_size=512, moe_intermediate_size=256, n_routed_experts=16,
                                     num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2)
    return randomize_moe_(DeepseekV3MoE(config), seed=1).to(dtype)


def qwen3_block(dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = tiny_qwen3_moe_config(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                   num_experts_per_tok=8)
    return randomize_moe_(Qwen3MoeSparseMoeBlock(config), seed=1).to(dtype)


BLOCKS = {"small": small_block, "qwen3": qwen3_block}


def _configs(block: torch.nn.Module) -> list:
    return [m.config for m in block.modules() if hasattr(m, "config") and hasattr(m.config,
                                                                                 "_experts_implementation")]


def step_under(module: torch.nn.Module, block: torch.nn.Module, impl: str, x: torch.Tensor,
               dy: torch.Tensor | None) -> Callable:
    """A step of ``module`` with ``block``'s experts implementation set to ``impl`` (the
    hpmoe layer shares the block's submodules and config: it runs the region under
    ``"hpmoe"``, transformers' experts under any other name)."""
    def run() -> None:
        for c in _configs(block):
            c._experts_implementation = impl
        _step(module, x, dy)
    return run


def _step(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor | None) -> None:
    if dy is None:
        with torch.no_grad():
            module(x)
        return
    for p in module.parameters():
        p.grad = None
    xg = x.detach().requires_grad_()
    module(xg).backward(dy)


def measure(variants: dict[str, Callable], rounds: int) -> dict[str, list[float]]:
    """Seconds per round of each variant; one untimed round first; balanced orders
    (``hpmoe.bench.order``: each variant right after each other one equally often)."""
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        for n in iteration_order(names, r):
            t0 = time.perf_counter()
            variants[n]()
            if r:
                times[n].append(time.perf_counter() - t0)
    return times


def run_case(name: str, dtype: torch.dtype, backward: bool, tokens: int, rounds: int) -> dict:
    block = BLOCKS[name](dtype)
    layer = MoE.from_hf(block)
    hidden = layer.spec.hidden
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, hidden, generator=g).to(dtype)
    dy = torch.randn(1, tokens, hidden, generator=g).to(dtype) if backward else None
    variants = {f"transformers_{i}": step_under(block, block, i, x, dy) for i in IMPLS}
    variants["hpmoe"] = step_under(layer, block, "hpmoe", x, dy)
    times = measure(variants, rounds)
    with torch.set_grad_enabled(backward):
        decision = layer.decision(tokens)
    med = {n: statistics.median(t) for n, t in times.items()}
    best = min(IMPLS, key=lambda i: med[f"transformers_{i}"])
    per_round = [min(times[f"transformers_{i}"][r] for i in IMPLS) / times["hpmoe"][r]
                 for r in range(rounds)]
    return {"case": name, "dtype": str(dtype).removeprefix("torch."),
            "mode": "fwd+bwd" if backward else "fwd", "tokens": tokens,
            **{f"{n}_ms": round(m * 1e3, 2) for n, m in med.items()},
            "best_transformers": best, "ratio": round(med[f"transformers_{best}"] / med["hpmoe"], 3),
            "round_ratio_min": round(min(per_round), 3), "round_ratio_max": round(max(per_round), 3),
            "hpmoe_runs": decision.chosen.name, "auto_reason": decision.reason.value}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="small,qwen3")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--small-tokens", type=int, default=4096)
    p.add_argument("--qwen-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    record()
    rows = []
    for name in args.cases.split(","):
        tokens = args.small_tokens if name == "small" else args.qwen_tokens
        for dtype in args.dtypes.split(","):
            for mode in args.modes.split(","):
                row = run_case(name, getattr(torch, dtype), mode == "fwd+bwd", tokens, args.rounds)
                rows.append(row)
                print(json.dumps(row) if args.json else _line(row), flush=True)


def _line(r: dict) -> str:
    return (f"{r['case']:6} {r['dtype']:9} {r['mode']:8} eager {r['transformers_eager_ms']:9.1f} "
            f"grouped_mm {r['transformers_grouped_mm_ms']:9.1f} hpmoe {r['hpmoe_ms']:9.1f} ms  "
            f"ratio {r['ratio']:.3f} (rounds {r['round_ratio_min']:.3f}-{r['round_ratio_max']:.3f})  "
            f"hpmoe runs {r['hpmoe_runs']} ({r['auto_reason']})")


if __name__ == "__main__":
    main()

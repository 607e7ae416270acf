"""Twenty routings of one shape for the per-shape plan's tests: balanced, zipf, one hot
expert, experts with no rows, every token on the same experts, and splits that fill
every slot the plan has (each expert 1 + a multiple of G rows)."""

from __future__ import annotations

import torch

from hpmoe.routing import Routing, RoutingKind, synthetic_routing
from hpmoe.spec import MoESpec, ParallelSpec


def from_counts(counts: list[int], tokens: int, top_k: int, seed: int) -> Routing:
    """A routing whose experts get ``counts`` rows: rows sorted by expert, token t takes
    rows t, t + T, ... (distinct experts while no count exceeds T), positive weights."""
    if sum(counts) != tokens * top_k or max(counts) > tokens:
        raise ValueError(f"counts {counts} do not fit {tokens} tokens of top-{top_k}")
    rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    ids = rows.view(top_k, tokens).t().contiguous()
    if (ids.sort(dim=1).values.diff(dim=1) == 0).any():
        raise ValueError(f"counts {counts} give a token the same expert twice")
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(tokens, top_k, generator=g) + 0.1
    return Routing(ids=ids, weights=w / w.sum(dim=1, keepdim=True))


def twenty_routings(spec: MoESpec, tokens: int, full: list[list[int]],
                    skewed: list[list[int]]) -> list[Routing]:
    """2 balanced, 7 zipf, 3 hot, 3 with empty experts (seeds 0..), ``full`` splits that
    fill every slot and ``skewed`` splits (each a list of rows per expert), 20 in all."""
    par = ParallelSpec(1, tokens)
    kinds = ([RoutingKind.BALANCED] * 2 + [RoutingKind.ZIPF] * 7 + [RoutingKind.HOT] * 3
             + [RoutingKind.EMPTY_EXPERTS] * 3)
    out = [synthetic_routing(kind, spec, par, seed) for seed, kind in enumerate(kinds)]
    out += [from_counts(c, tokens, spec.top_k, 100 + i) for i, c in enumerate(full + skewed)]
    if len(out) != 20:
        raise ValueError(f"{len(out)} routings, expected 20")
    return out

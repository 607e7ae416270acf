"""The one small collective before a region: token counts per (expert, token tile).

Every rank's graph — and every schedule, which needs all ranks — depends on the
routing only through how many of each source's rows go to each expert, and, for
the combine's signals, through which source token tile each row belongs to.  Rows
of one (source, expert) segment are in token order, so the counts per (expert,
token tile) of every source determine both.  Each rank all-gathers its
``[E, token_tiles]`` int32 counts and rebuilds a ``RoutingPlan`` whose graph equals
the one built from every rank's ids: its own rows are exact; a peer's rows are
stand-ins with the same (expert, token tile) counts, which no kernel of this rank
ever reads.
"""

from __future__ import annotations

import torch

from ..regions.layout import ceil_div
from ..routing import Routing, RoutingPlan, plan_routing
from ..spec import MoESpec, ParallelSpec
from .collective import Collectives


def tile_counts(ids: torch.Tensor, experts: int, rows: int) -> torch.Tensor:
    """[E, ceil(T / rows)] int32: rows of ``ids`` ([T, k] int64) per (expert, token tile)."""
    t, k = ids.shape
    tiles = int(ceil_div(t, rows))
    tile = (torch.arange(t, device=ids.device) // rows).repeat_interleave(k)
    flat = ids.reshape(-1) * tiles + tile
    return torch.bincount(flat, minlength=experts * tiles).view(experts, tiles).to(torch.int32)


def exchange_tile_counts(ids: torch.Tensor, experts: int, rows: int, coll: Collectives,
                         what: str = "count exchange") -> torch.Tensor:
    """[ep, E, token_tiles] int32: every rank's ``tile_counts`` (one all-gather under
    the session's deadline; its status word goes out with the next heartbeat)."""
    return coll.all_gather(tile_counts(ids, experts, rows), what, publish=False)


def stand_in_ids(counts: torch.Tensor, tokens: int, top_k: int, rows: int) -> torch.Tensor:
    """[T, k] int64 ids with the (expert, token tile) counts ``counts`` ([E, tiles]),
    token tiles of ``rows`` tokens."""
    experts, tiles = counts.shape
    per_tile = counts.sum(dim=0)
    expected = torch.tensor([min(rows, tokens - j * rows) * top_k for j in range(tiles)],
                            device=counts.device)
    if not torch.equal(per_tile.long(), expected):
        raise ValueError(f"token counts per tile {per_tile.tolist()} do not match {tokens} tokens "
                         f"of top-{top_k} in tiles of {rows}")
    values = torch.arange(experts, device=counts.device).repeat(tiles)
    return torch.repeat_interleave(values, counts.t().reshape(-1).long()).view(tokens, top_k)


def plan_from_tile_counts(ids: torch.Tensor, counts: torch.Tensor, moe: MoESpec, par: ParallelSpec,
                          rank: int, rows: int, checked: bool = False) -> RoutingPlan:
    """The plan of every rank from this rank's ``ids`` ([T, k] int64) and every rank's
    tile counts ([ep, E, ceil(T / rows)] int32, as exchanged); ``checked``: as
    ``plan_routing``'s."""
    t = par.tokens_per_rank
    shape = (par.ep, moe.experts, int(ceil_div(t, rows)))
    if tuple(counts.shape) != shape:
        raise ValueError(f"tile counts have shape {tuple(counts.shape)}, expected {list(shape)}")
    parts = [ids if r == rank else stand_in_ids(counts[r], t, moe.top_k, rows) for r in range(par.ep)]
    return plan_routing(torch.cat(parts), moe, par, checked)


def exchange_routing(routing: Routing, coll: Collectives, what: str = "routing exchange") -> Routing:
    """Every rank's routing, ids [ep*T, k] int64 and weights float32, from this rank's
    ([T, k]): one all-gather of the ids (int32) beside the weights' bits.  What the
    deduplicated regions need: a receiver expands a row to the experts its source chose
    and weighs their outputs."""
    k = routing.ids.shape[1]
    packed = torch.cat([routing.ids.to(torch.int32), routing.weights.float().contiguous().view(torch.int32)],
                       dim=1)
    every = coll.all_gather(packed, what, publish=False).reshape(-1, 2 * k)
    return Routing(ids=every[:, :k].long(), weights=every[:, k:].contiguous().view(torch.float32))

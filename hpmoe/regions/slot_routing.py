"""A call's routing resolved onto a per-shape plan's slots, on the ids' device.

``resolve_slots`` is the whole per-call planning of a ``slots.SlotPlan``: a handful of
tensor operations on the device that holds the ids (sort -> histogram -> cumsum, as
MegaBlocks builds its routing state), no host read, no Python loop over experts or rows:

  1. count each expert's rows (a scatter-add) and its slots, ceil(count / G);
  2. the slots' exclusive cumsum puts expert e's rows at slot ``first[e]``; slot s
     serves the expert whose slot range holds it (``bucketize``) and has
     ``clip(count[e] - (s - first[e]) * G, 0, G)`` live rows (0 past the last used slot);
  3. a stable sort of the flat ids orders each expert's rows by token, as
     ``routing.plan_routing`` does, and gives every (token, j) its row in the slot layout.

The rows of an expert therefore sit in the same order, cut at the same G-row boundaries,
as in a routing plan's graph: each GEMM tile multiplies the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .slots import SlotShape


@dataclass(frozen=True)
class SlotRouting:
    """One call's routing in the slot layout, on the ids' device.

    counts: [E] int64 rows per expert.  first: [E] int64 each expert's first slot (its
    rows start at row ``first * G``).  slot_expert: [S] int64 expert each slot serves
    (an unused slot: the last expert, never read).  slot_rows: [S] int64 live rows.
    pos: [T, k] int64 slot-layout row of each (token, j).  row_token: [S*G] int64 token
    of each row (0 in rows no token fills)."""

    counts: torch.Tensor
    first: torch.Tensor
    slot_expert: torch.Tensor
    slot_rows: torch.Tensor
    pos: torch.Tensor
    row_token: torch.Tensor


def resolve_slots(ids: torch.Tensor, shape: SlotShape) -> SlotRouting:
    """``ids`` [T, k] int64 in [0, E) (checked by the caller), resolved onto ``shape``'s
    slots on their device."""
    g, experts, k = shape.tiles.gemm_rows, shape.moe.experts, shape.moe.top_k
    flat = ids.reshape(-1)
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    slots = (counts + g - 1) // g
    last = torch.cumsum(slots, 0)
    first = last - slots
    at = torch.arange(shape.slots, device=flat.device)
    slot_expert = torch.bucketize(at, last, right=True).clamp_(max=experts - 1)
    slot_rows = (counts[slot_expert] - (at - first[slot_expert]) * g).clamp_(0, g)
    expert, order = torch.sort(flat, stable=True)
    rank = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert]
    row = first[expert] * g + rank
    pos = torch.empty_like(flat).index_put_((order,), row)
    row_token = torch.zeros(shape.capacity, dtype=torch.int64, device=flat.device)
    row_token.index_put_((row,), order // k)
    return SlotRouting(counts=counts, first=first, slot_expert=slot_expert, slot_rows=slot_rows,
                       pos=pos.view(-1, k), row_token=row_token)


def live_rows(slot_rows: torch.Tensor, slot: torch.Tensor, offset: torch.Tensor,
              cap: torch.Tensor) -> torch.Tensor:
    """[m] int64 live rows of each slot task (``slots.SlotTasks`` as tensors on the
    device of ``slot_rows``): ``clip(slot_rows[slot] - offset, 0, cap)``."""
    return torch.minimum((slot_rows[slot] - offset).clamp_(min=0), cap)

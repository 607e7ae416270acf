"""The memory-bound phases of kernel by kernel's region — everything between its GEMMs
and exchanges: the permute's gather, the gated activation and its gradient, the
weighted combine (the unpermute), its gradient and the backward's unpermute — as one
table of functions (``Phases``).  ``TORCH`` holds the torch versions, the reference;
a device's one-launch versions (``hpmoe.gpu.phases.TRITON``) take the same arguments
and give the same bits where their order of fp32 operations is the same.  The engine
picks the table for the input's device (``engine.selection``); kernel by kernel calls
whatever it is handed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..regions.backward_kernels import glu_backward, glu_router_backward
from ..regions.kernels import glu
from .arena import Arena


def permute(x: torch.Tensor, order: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """out [T*k, H] = x[order // k]: the rows of sorted (token, slot) pairs (order [T*k]
    int64 flat indices ``t*k + j``)."""
    return torch.index_select(x, 0, order // k, out=out)


CHUNK_BYTES = 1 << 20  # a token block's fp32 sum buffer: small enough to stay in cache


def token_blocks(tokens: int, hidden: int, device: torch.device) -> list[slice]:
    """Blocks of tokens whose [block, hidden] fp32 buffer is about ``CHUNK_BYTES`` on a
    CPU; elsewhere one block (a GPU gains nothing from cache blocking and would pay a
    launch per block and slot: DeepSeek-V3's 4096 tokens made 114 blocks)."""
    if device.type != "cpu":
        return [slice(0, tokens)]
    rows = max(1, CHUNK_BYTES // (4 * max(hidden, 1)))
    return [slice(s, min(s + rows, tokens)) for s in range(0, tokens, rows)]


def weighted_sum(rows: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, shared: torch.Tensor | None,
                 arena: Arena) -> torch.Tensor:
    """``refs.topk_sum`` of sorted rows [T*k, H]: out[t] = sum_j w[t, j] * rows[pos[t, j]]
    in fp32, slot 0 first, shared [T, H] last; [T, H] in rows.dtype (a fresh tensor).
    Block by block of tokens, so a block's partial sums stay in cache over the k slots
    (the same operations per element, so the same bits)."""
    t, k = pos.shape
    acc = _accumulator(arena, (t, rows.shape[1]), rows.dtype)
    tmp = arena.take("tmp", tuple(acc.shape), torch.float32)
    picked = arena.take("picked", tuple(acc.shape), rows.dtype)
    for b in token_blocks(t, rows.shape[1], rows.device):
        a, p, tb, pb, wb = acc[b], picked[b], tmp[b], pos[b], w[b]  # this block's views, once
        for j in range(k):
            torch.index_select(rows, 0, pb[:, j], out=p)
            torch.mul(p, wb[:, j:j + 1], out=a if j == 0 else tb)
            if j:
                a.add_(tb)
        if k == 0:
            a.zero_()
        if shared is not None:
            a.add_(shared[b])
    return acc.to(rows.dtype)


def _accumulator(arena: Arena, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The fp32 sum buffer of a result in ``dtype``: from the arena unless the result
    is fp32 itself (``Tensor.to`` would then return the arena's buffer to the caller)."""
    if dtype == torch.float32:
        return torch.empty(shape, dtype=torch.float32, device=arena.device)
    return arena.take("acc", shape, torch.float32)


def weighted_sum_backward(g: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, w: torch.Tensor,
                          arena: Arena) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``weighted_sum`` given g [T, H] (the output's gradient, any float
    dtype; read in fp32): (dw [T, k] fp32, drows [T*k, H] rows.dtype in sorted order,
    arena)."""
    g = g.float()
    t, k = pos.shape
    dw = torch.empty(t, k, dtype=torch.float32, device=g.device)
    tmp = arena.take("tmp", tuple(g.shape), torch.float32)
    picked = arena.take("picked", tuple(g.shape), rows.dtype)
    drows = arena.take("drows", tuple(rows.shape), rows.dtype)
    for j in range(k):
        torch.index_select(rows, 0, pos[:, j], out=picked)
        torch.mul(picked, g, out=tmp)
        torch.sum(tmp, 1, out=dw[:, j])
        torch.mul(g, w[:, j:j + 1], out=tmp)
        picked.copy_(tmp)
        drows.index_copy_(0, pos[:, j], picked)
    return dw, drows


def slot_sum(rows: torch.Tensor, pos: torch.Tensor, extra: torch.Tensor | None, arena: Arena) -> torch.Tensor:
    """out[t] = sum_j rows[pos[t, j]] (+ extra[t]) in fp32, slot order; [T, H] rows.dtype."""
    t, k = pos.shape
    acc = _accumulator(arena, (t, rows.shape[1]), rows.dtype)
    picked = arena.take("picked", tuple(acc.shape), rows.dtype)
    acc.zero_()
    for j in range(k):
        acc.add_(torch.index_select(rows, 0, pos[:, j], out=picked))
    if extra is not None:
        acc.add_(extra)
    return acc.to(rows.dtype)


@dataclass(frozen=True)
class Phases:
    """The functions kernel by kernel runs its memory-bound phases with (the torch ones
    by default): ``permute(x, order, k, out)``, ``glu(h, out, activation, form)``,
    ``glu_backward(h, da, dh, activation, tmp, form)``, ``weighted_sum(rows, pos, w,
    shared, arena)``, ``weighted_sum_backward(g, rows, pos, w, arena)``,
    ``slot_sum(rows, pos, extra, arena)``, ``glu_router_backward(h, d, w, dh, a_w,
    activation, form)``."""

    permute: Callable = permute
    glu: Callable = glu
    glu_backward: Callable = glu_backward
    weighted_sum: Callable = weighted_sum
    weighted_sum_backward: Callable = weighted_sum_backward
    slot_sum: Callable = slot_sum
    glu_router_backward: Callable = glu_router_backward


TORCH = Phases()

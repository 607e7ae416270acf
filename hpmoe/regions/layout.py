"""Tiles and event ids shared by the forward and backward lowerings.

Everything here is a pure function of the ``RoutingPlan`` (which every rank knows
after the token-count exchange) and the ``TileSpec``, so each rank can compute the
event ids of its peers without asking them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..routing import RoutingPlan
from ..spec import TileSpec


def expand(n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For counts ``n``: (parent index, index within parent) of every child."""
    n = np.asarray(n, np.int64)
    parent = np.repeat(np.arange(len(n)), n)
    start = np.cumsum(n) - n
    return parent, np.arange(int(n.sum())) - start[parent]


def ceil_div(a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
    return -(-np.asarray(a, np.int64) // b)


def exclusive_cumsum(n: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.cumsum(n, axis=axis) - n


@dataclass(frozen=True)
class Blocks:
    """GEMM row blocks of every rank: block i covers receive rows [row0, row1) of
    local expert ``expert`` on ``rank``; ``local`` is its id within the rank."""

    rank: np.ndarray
    expert: np.ndarray
    row0: np.ndarray
    row1: np.ndarray
    local: np.ndarray
    count: np.ndarray  # [ep] blocks per rank
    base: np.ndarray  # [ep, L] local id of each expert's first block
    per_expert: np.ndarray  # [ep, L] blocks of each expert


@dataclass(frozen=True)
class Pieces:
    """One piece per (source, destination, expert, block, <= tiles.rows rows): the
    unit moved by one dispatch or combine put.  ``block`` is the local block id on
    ``dst``; ``send_row0`` is in the source's permuted buffer, ``recv_row0`` in the
    destination's receive buffer; ``local`` is the piece's id among its source's."""

    src: np.ndarray
    dst: np.ndarray
    expert: np.ndarray
    block: np.ndarray
    send_row0: np.ndarray
    recv_row0: np.ndarray
    rows: np.ndarray
    local: np.ndarray
    per_src: np.ndarray  # [ep]


@dataclass(frozen=True)
class Layout:
    """Tiles of a plan, shared by every region: GEMM row blocks, put pieces, token
    tiles and shared-expert blocks.  Each region lays its events out over these."""

    plan: RoutingPlan
    tiles: TileSpec
    blocks: Blocks
    pieces: Pieces
    token_tiles: int
    shared_rows: int  # rows per shared-expert GEMM block
    shared_blocks: int  # 0 without shared experts


def gemm_blocks(plan: RoutingPlan, tiles: TileSpec) -> Blocks:
    """Split each expert's receive rows into GEMM row blocks (whole expert when
    ``tiles.gemm_rows`` is 0)."""
    ep, local = plan.par.ep, plan.local_experts
    n = plan.counts.sum(dim=0).numpy()  # [dst, L]
    start = plan.recv_offsets.numpy()[:, : local * ep : ep]  # [dst, L]
    g = tiles.gemm_rows or max(int(n.max()), 1)
    nb = ceil_div(n, g)
    flat, b = expand(nb.ravel())
    rank, expert = flat // local, flat % local
    row0 = start[rank, expert] + b * g
    row1 = np.minimum(row0 + g, start[rank, expert] + n[rank, expert])
    base = exclusive_cumsum(nb, axis=1)
    return Blocks(rank=rank, expert=expert, row0=row0, row1=row1, local=base[rank, expert] + b,
                  count=nb.sum(axis=1), base=base, per_expert=nb)


def put_pieces(plan: RoutingPlan, tiles: TileSpec, blocks: Blocks) -> Pieces:
    """Cut every (source, destination, expert) segment at GEMM block boundaries and
    then into chunks of at most ``tiles.rows`` rows."""
    ep, local = plan.par.ep, plan.local_experts
    counts = plan.counts.numpy()
    s, d, e = np.nonzero(counts)
    c = counts[s, d, e]
    exp_start = plan.recv_offsets.numpy()[d, e * ep]
    rel = plan.recv_offsets.numpy()[d, e * ep + s] - exp_start
    send = plan.send_offsets.numpy()[s, d * local + e]
    g = tiles.gemm_rows or max(int(plan.counts.sum(dim=0).max()), 1)
    b0 = rel // g
    seg, k = expand((rel + c - 1) // g - b0 + 1)
    bidx = b0[seg] + k
    lo = np.maximum(rel[seg], bidx * g)
    hi = np.minimum(rel[seg] + c[seg], (bidx + 1) * g)
    sub, j = expand(ceil_div(hi - lo, tiles.rows))
    p0 = lo[sub] + j * tiles.rows
    rows = np.minimum(p0 + tiles.rows, hi[sub]) - p0
    seg = seg[sub]
    src = s[seg]
    per_src = np.bincount(src, minlength=ep)
    return Pieces(src=src, dst=d[seg], expert=e[seg], block=blocks.base[d[seg], e[seg]] + bidx[sub],
                  send_row0=send[seg] + p0 - rel[seg], recv_row0=exp_start[seg] + p0, rows=rows,
                  local=np.arange(len(src)) - exclusive_cumsum(per_src)[src], per_src=per_src)


def make_layout(plan: RoutingPlan, tiles: TileSpec) -> Layout:
    """All tiles and event ids of ``plan`` (every rank)."""
    blocks = gemm_blocks(plan, tiles)
    tpr = plan.par.tokens_per_rank
    shared_rows = tiles.gemm_rows or tpr
    shared_blocks = int(ceil_div(tpr, shared_rows)) if plan.moe.shared_experts else 0
    return Layout(plan=plan, tiles=tiles, blocks=blocks, pieces=put_pieces(plan, tiles, blocks),
                  token_tiles=int(ceil_div(tpr, tiles.rows)), shared_rows=shared_rows,
                  shared_blocks=shared_blocks)


def piece_token_tiles(layout: Layout, select: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (piece, source token tile) pairs of the selected pieces, sorted by
    piece: which token tiles' outputs each piece carries rows of."""
    p = layout.pieces
    ids = np.flatnonzero(select)
    which, r = expand(p.rows[ids])
    piece = ids[which]
    row = p.send_row0[piece] + r
    k = layout.plan.moe.top_k
    token = layout.plan.order.numpy()[p.src[piece], row] // k
    key = np.unique(piece * layout.token_tiles + token // layout.tiles.rows)
    return key // layout.token_tiles, key % layout.token_tiles

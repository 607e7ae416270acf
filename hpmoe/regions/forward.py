"""Forward lowering: a ``RoutingPlan`` becomes the tile task graph of the
Dispatch-to-Combine region (plus permute, unpermute and shared experts).

Per rank, in the order data flows:
  PERMUTE    one per put piece: gather its rows of x into the send buffer;
  DISPATCH   one per piece: put the rows into the expert owner's receive buffer;
  GEMM_UP    one per (GEMM block, column tile of 2F), after every piece of its block;
  SWIGLU     one per (block, <= tiles.rows rows), after all GEMM_UP tiles of the block;
  GEMM_DOWN  one per (block, column tile of H), after all SWIGLU tiles of the block;
  COMBINE    one per piece: put the expert outputs back into the source's buffer;
  UNPERMUTE  one per token tile: fixed-order fp32 weighted sum of the token's k rows
             plus the shared-expert output, after exactly the pieces and shared
             tiles that carry its rows;
  SHARED_*   shared-expert GEMM/SwiGLU tiles on the rank's own tokens.
Empty experts, ranks and tiles produce no tasks: sizes come from the actual routing.
"""

from __future__ import annotations

import numpy as np

from ..ir.graph import GraphBuilder, TaskBlock, TaskGraph, TaskKind
from ..routing import RoutingPlan
from ..spec import TileSpec
from .layout import Layout, ceil_div, expand, make_layout, piece_token_tiles


def lower_forward(plan: RoutingPlan, tiles: TileSpec, ranks: tuple[int, ...] | None = None) -> TaskGraph:
    """The forward task graph of ``ranks`` (default: every rank of the EP group)."""
    ep = plan.par.ep
    ranks = tuple(range(ep)) if ranks is None else tuple(sorted(set(ranks)))
    if any(not 0 <= r < ep for r in ranks):
        raise ValueError(f"ranks={ranks} outside the EP group of size {ep}")
    layout = make_layout(plan, tiles)
    sel = np.zeros(ep, bool)
    sel[list(ranks)] = True
    builder = GraphBuilder(ep, ranks)
    # Phase order, so that task-id order is itself a valid (serial) execution order.
    for make in (_permute, _dispatch, _gemm_up, _swiglu, _gemm_down, _combine, _shared_up,
                 _shared_swiglu, _shared_down, _unpermute):
        builder.add(make(layout, sel))
    shared_out = _shared_down_per_token_tile(layout)  # the same on every rank
    for r in ranks:
        builder.set_events(r, forward_thresholds(layout, r, shared_out))
    return builder.freeze(meta={"layout": layout, "direction": "forward"})


def forward_thresholds(layout: Layout, rank: int, shared_out: np.ndarray) -> np.ndarray:
    """Thresholds of ``rank``'s events, computed from the layout alone;
    ``shared_out``: shared-expert tiles signalling each token tile."""
    plan, blocks, pieces = layout.plan, layout.blocks, layout.pieces
    moe = plan.moe
    nb = int(blocks.count[rank])
    mine = blocks.rank == rank
    rows = np.bincount(pieces.block[pieces.dst == rank], minlength=nb)
    h = np.full(nb, _ntiles(2 * moe.ffn, layout.tiles))
    a = ceil_div(blocks.row1[mine] - blocks.row0[mine], layout.tiles.rows)
    y = np.full(nb, _ntiles(moe.hidden, layout.tiles))
    _, tt = piece_token_tiles(layout, pieces.src == rank)
    out = np.bincount(tt, minlength=layout.token_tiles) + shared_out
    sh = np.full(layout.shared_blocks, _ntiles(2 * moe.shared_ffn, layout.tiles))
    sa = ceil_div(_shared_block_rows(layout), layout.tiles.rows)
    perm = np.ones(int(pieces.per_src[rank]), np.int64)
    return np.concatenate([rows, h, a, y, out, sh, sa, perm]).astype(np.int64)


# ------------------------------------------------------------------ helpers

def _ntiles(width: int, tiles: TileSpec) -> int:
    return int(ceil_div(width, tiles.column_tile(width)))


def _esize(layout: Layout) -> int:
    return layout.plan.moe.dtype.itemsize


def _block(kind: TaskKind, rank: np.ndarray, row0: np.ndarray, row1: np.ndarray, **cols) -> TaskBlock:
    """A ``TaskBlock`` with defaults: no peer, expert, columns, work, wait or signal."""
    n = len(rank)
    zeros = np.zeros(n, np.int64)
    sig_count = cols.pop("sig_count", np.ones(n, np.int64) if "sig_event" in cols else zeros)
    base = {"peer": rank, "expert": np.full(n, -1), "col0": zeros, "col1": zeros, "dst_row0": row0,
            "flops": zeros, "bytes": zeros, "link_bytes": zeros, "wait": np.full(n, -1),
            "sig_rank": rank if "sig_event" in cols else zeros[:0], "sig_event": zeros[:0]}
    base.update(cols)
    return TaskBlock(kind=kind, rank=rank, row0=row0, row1=row1, sig_count=sig_count, **base)


def _col_tiles(width: int, tiles: TileSpec, parents: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parent, col0, col1) for every column tile of every parent."""
    cols = tiles.column_tile(width)
    parent, j = expand(np.full(parents, _ntiles(width, tiles)))
    col0 = j * cols
    return parent, col0, np.minimum(col0 + cols, width)


def _row_chunks(row0: np.ndarray, row1: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parent, chunk row0, chunk row1) splitting each [row0, row1) in chunks of ``rows``."""
    parent, j = expand(ceil_div(row1 - row0, rows))
    r0 = row0[parent] + j * rows
    return parent, r0, np.minimum(r0 + rows, row1[parent])


def _gemm_weight_share(layout: Layout, rank: np.ndarray, expert: np.ndarray) -> np.ndarray:
    """1 / (blocks of the expert).

    Memory traffic counts every byte once per reuse group, as a cache holding the
    operands would: an expert's weights are read once across its row blocks and a
    block's input rows once across its column tiles (the cost model's assumption)."""
    return 1.0 / layout.blocks.per_expert[rank, expert]


# ------------------------------------------------------------------ dispatch side

def _permute(layout: Layout, sel: np.ndarray) -> TaskBlock:
    p = layout.pieces
    i = np.flatnonzero(sel[p.src])
    h = layout.plan.moe.hidden
    return _block(TaskKind.PERMUTE, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                  expert=p.expert[i], bytes=2 * p.rows[i] * h * _esize(layout),
                  sig_event=layout.base(p.src[i], "PERM") + p.local[i])


def _put(kind: TaskKind, layout: Layout, i: np.ndarray, wait: np.ndarray) -> dict:
    """Columns shared by dispatch and combine puts of pieces ``i``."""
    p = layout.pieces
    nbytes = p.rows[i] * layout.plan.moe.hidden * _esize(layout)
    return {"expert": p.expert[i], "bytes": 2 * nbytes,
            "link_bytes": np.where(p.src[i] != p.dst[i], nbytes, 0), "wait": wait}


def _dispatch(layout: Layout, sel: np.ndarray) -> TaskBlock:
    p = layout.pieces
    i = np.flatnonzero(sel[p.src])
    cols = _put(TaskKind.DISPATCH, layout, i, layout.base(p.src[i], "PERM") + p.local[i])
    return _block(TaskKind.DISPATCH, p.src[i], p.send_row0[i], p.send_row0[i] + p.rows[i],
                  peer=p.dst[i], dst_row0=p.recv_row0[i], sig_rank=p.dst[i],
                  sig_event=layout.base(p.dst[i], "ROWS") + p.block[i], **cols)


def _combine(layout: Layout, sel: np.ndarray) -> TaskBlock:
    p = layout.pieces
    i = np.flatnonzero(sel[p.dst])
    piece, tt = piece_token_tiles(layout, sel[p.dst])
    cols = _put(TaskKind.COMBINE, layout, i, layout.base(p.dst[i], "Y") + p.block[i])
    return _block(TaskKind.COMBINE, p.dst[i], p.recv_row0[i], p.recv_row0[i] + p.rows[i],
                  peer=p.src[i], dst_row0=p.send_row0[i], sig_count=np.bincount(
                      np.searchsorted(i, piece), minlength=len(i)),
                  sig_rank=p.src[piece], sig_event=layout.base(p.src[piece], "OUT") + tt, **cols)


# ------------------------------------------------------------------ experts

def _gemm(kind: TaskKind, layout: Layout, sel: np.ndarray, width: int, depth: int,
          wait: str, signal: str) -> TaskBlock:
    """GEMM tiles over every selected block: [rows, depth] @ [depth, width-tile]."""
    b = layout.blocks
    blk = np.flatnonzero(sel[b.rank])
    parent, col0, col1 = _col_tiles(width, layout.tiles, len(blk))
    i = blk[parent]
    rank, m, n = b.rank[i], b.row1[i] - b.row0[i], col1 - col0
    weights = n * depth * _gemm_weight_share(layout, rank, b.expert[i])
    inputs = m * depth / _ntiles(width, layout.tiles)
    return _block(kind, rank, b.row0[i], b.row1[i], expert=b.expert[i], col0=col0, col1=col1,
                  flops=2.0 * m * n * depth, bytes=(inputs + m * n + weights) * _esize(layout),
                  wait=layout.base(rank, wait) + b.local[i],
                  sig_event=layout.base(rank, signal) + b.local[i])


def _gemm_up(layout: Layout, sel: np.ndarray) -> TaskBlock:
    moe = layout.plan.moe
    return _gemm(TaskKind.GEMM_UP, layout, sel, 2 * moe.ffn, moe.hidden, "ROWS", "H")


def _gemm_down(layout: Layout, sel: np.ndarray) -> TaskBlock:
    moe = layout.plan.moe
    return _gemm(TaskKind.GEMM_DOWN, layout, sel, moe.hidden, moe.ffn, "A", "Y")


def _swiglu(layout: Layout, sel: np.ndarray) -> TaskBlock:
    b = layout.blocks
    blk = np.flatnonzero(sel[b.rank])
    parent, r0, r1 = _row_chunks(b.row0[blk], b.row1[blk], layout.tiles.rows)
    i = blk[parent]
    f = layout.plan.moe.ffn
    return _block(TaskKind.SWIGLU, b.rank[i], r0, r1, expert=b.expert[i], col1=np.full(len(i), f),
                  flops=5.0 * (r1 - r0) * f, bytes=3 * (r1 - r0) * f * _esize(layout),
                  wait=layout.base(b.rank[i], "H") + b.local[i],
                  sig_event=layout.base(b.rank[i], "A") + b.local[i])


# ------------------------------------------------------------------ source side

def _token_tiles(layout: Layout, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rank, tile index, row0, row1) of every token tile of the selected ranks."""
    tpr, rows = layout.plan.par.tokens_per_rank, layout.tiles.rows
    rank, t = expand(np.where(sel, layout.token_tiles, 0))
    return rank, t, t * rows, np.minimum((t + 1) * rows, tpr)


def _unpermute(layout: Layout, sel: np.ndarray) -> TaskBlock:
    moe = layout.plan.moe
    rank, t, r0, r1 = _token_tiles(layout, sel)
    m = r1 - r0
    terms = moe.top_k + (1 if moe.shared_experts else 0)
    return _block(TaskKind.UNPERMUTE, rank, r0, r1, col1=np.full(len(rank), moe.hidden),
                  flops=2.0 * terms * m * moe.hidden,
                  bytes=(terms * moe.hidden * m * _esize(layout) + m * moe.hidden * _esize(layout)),
                  wait=layout.base(rank, "OUT") + t)


def _shared_block_rows(layout: Layout) -> np.ndarray:
    tpr, s = layout.plan.par.tokens_per_rank, layout.shared_rows
    r0 = np.arange(layout.shared_blocks) * s
    return np.minimum(r0 + s, tpr) - r0


def _shared_blocks(layout: Layout, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rank, block, row0, row1) of the shared-expert row blocks of selected ranks."""
    rank, b = expand(np.where(sel, layout.shared_blocks, 0))
    r0 = b * layout.shared_rows
    return rank, b, r0, r0 + _shared_block_rows(layout)[b]


def _shared_gemm(kind: TaskKind, layout: Layout, sel: np.ndarray, width: int, depth: int,
                 wait: str | None, signal: str | None) -> TaskBlock:
    rank, b, r0, r1 = _shared_blocks(layout, sel)
    parent, col0, col1 = _col_tiles(width, layout.tiles, len(rank))
    rank, b, r0, r1 = rank[parent], b[parent], r0[parent], r1[parent]
    m, n = r1 - r0, col1 - col0
    cols = {"col0": col0, "col1": col1, "flops": 2.0 * m * n * depth,
            "bytes": (m * depth / _ntiles(width, layout.tiles) + m * n + n * depth / layout.shared_blocks)
            * _esize(layout)}
    if wait:
        cols["wait"] = layout.base(rank, wait) + b
    if signal:
        cols["sig_event"] = layout.base(rank, signal) + b
    return _block(kind, rank, r0, r1, **cols)


def _shared_up(layout: Layout, sel: np.ndarray) -> TaskBlock:
    moe = layout.plan.moe
    return _shared_gemm(TaskKind.SHARED_UP, layout, sel, 2 * moe.shared_ffn, moe.hidden, None, "SH")


def _shared_swiglu(layout: Layout, sel: np.ndarray) -> TaskBlock:
    rank, b, r0, r1 = _shared_blocks(layout, sel)
    parent, c0, c1 = _row_chunks(r0, r1, layout.tiles.rows)
    rank, b = rank[parent], b[parent]
    f = layout.plan.moe.shared_ffn
    return _block(TaskKind.SHARED_SWIGLU, rank, c0, c1, col1=np.full(len(rank), f),
                  flops=5.0 * (c1 - c0) * f, bytes=3 * (c1 - c0) * f * _esize(layout),
                  wait=layout.base(rank, "SH") + b, sig_event=layout.base(rank, "SA") + b)


def _shared_down(layout: Layout, sel: np.ndarray) -> TaskBlock:
    moe = layout.plan.moe
    blk = _shared_gemm(TaskKind.SHARED_DOWN, layout, sel, moe.hidden, moe.shared_ffn, "SA", None)
    rows = layout.tiles.rows
    first, last = blk.row0 // rows, (blk.row1 - 1) // rows
    parent, j = expand(last - first + 1)
    blk.sig_count = last - first + 1
    blk.sig_rank = blk.rank[parent]
    blk.sig_event = layout.base(blk.rank[parent], "OUT") + first[parent] + j
    return blk


def _shared_down_per_token_tile(layout: Layout) -> np.ndarray:
    """Shared GEMM_DOWN tiles that signal each token tile of one rank."""
    blk = _shared_down(layout, np.array([True] + [False] * (layout.plan.par.ep - 1)))
    return np.bincount(blk.sig_event - layout.base(0, "OUT"), minlength=layout.token_tiles)

"""Tile builders shared by the forward and backward lowerings.

Every builder reads a ``Lowering`` (the layout, the region's event layout and the
selected ranks) and returns one ``TaskBlock`` of columns; a region's lowering is the
list of its builders in phase order.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import TypeVar

import numpy as np
import torch

from ..deprecation import deprecated
from ..ir.events import EventLayout
from ..ir.graph import IS_PUT, GraphBuilder, TaskBlock, TaskGraph, TaskKind
from ..spec import TileSpec
from .base import Kept
from .layout import Layout, ceil_div, expand


@dataclass(frozen=True)
class Lowering:
    """What every builder reads: the layout, the event ids, the selected ranks
    ([ep] bool), for backward what it finds kept (``base.Kept``), and ``toward``: ranks
    whose incoming puts are built too ([ep] bool; None: none)."""

    layout: Layout
    events: EventLayout
    sel: np.ndarray
    kept: Kept = Kept.ALL
    toward: np.ndarray | None = None

    @property
    def esize(self) -> int:
        """Bytes per element of the layer's dtype."""
        return self.layout.plan.moe.dtype.itemsize

    def picks(self, rank: np.ndarray, peer: np.ndarray) -> np.ndarray:
        """Which puts (run by ``rank``, into ``peer``) this lowering builds."""
        mine = self.sel[rank]
        return mine if self.toward is None else mine | self.toward[peer]

    def only(self, rank: int) -> Lowering:
        """Deprecated: the same lowering restricted to ``rank``."""
        deprecated("Lowering.only", "a Lowering of its own sel (lower_graph restricts every phase)")
        sel = np.zeros_like(self.sel)
        sel[rank] = True
        return Lowering(self.layout, self.events, sel, self.kept)

    def every(self) -> Lowering:
        """The same lowering over every rank."""
        return Lowering(self.layout, self.events, np.ones_like(self.sel), self.kept)

    def incoming(self) -> Lowering:
        """The puts of every rank into the selected ones, and nothing else: what the
        selected ranks' thresholds count besides their own tasks' signals."""
        return Lowering(self.layout, self.events, np.zeros_like(self.sel), self.kept, toward=self.sel)


def select_ranks(ep: int, ranks: tuple[int, ...] | None) -> tuple[tuple[int, ...], np.ndarray]:
    """(sorted ranks, [ep] bool mask); default every rank.  ValueError outside the group."""
    ranks = tuple(range(ep)) if ranks is None else tuple(sorted(set(ranks)))
    if any(not 0 <= r < ep for r in ranks):
        raise ValueError(f"ranks={ranks} outside the EP group of size {ep}")
    sel = np.zeros(ep, bool)
    sel[list(ranks)] = True
    return ranks, sel


L = TypeVar("L")


def lower_graph(phases: Sequence[Callable[[L], TaskBlock]], low: L, every: L, sel: np.ndarray,
                events: EventLayout, dtype: torch.dtype, nodes: int = 1) -> TaskGraph:
    """The task graph of the selected ranks (``sel``, [ep] bool): each phase's tasks on
    them, in phase order (so that task-id order is itself a valid serial execution order),
    and each event's threshold the number of signals it receives.  A task signals its own
    rank's events, a put its peer's: short of every rank, the puts are counted from
    ``every``, a lowering that builds (at least) every put into the selected ranks.  A
    phase may build tasks of other ranks too; they are left out."""
    ptr = np.concatenate([[0], np.cumsum(events.offset[:, -1])])
    ranks = tuple(int(r) for r in np.flatnonzero(sel))
    builder, signalled = GraphBuilder(len(sel), ranks), []
    for make in phases:
        blk = make(low)
        counted = make(every) if IS_PUT[blk.kind] and not sel.all() else blk
        if counted is blk and not sel.all() and (blk.sig_rank != np.repeat(blk.rank, blk.sig_count)).any():
            raise AssertionError(f"{TaskKind(blk.kind).name} tasks signal another rank's events but are not "
                                 "puts: the selected ranks' thresholds would miss those signals")
        signalled.append(ptr[counted.sig_rank] + counted.sig_event)
        builder.add(only_ranks(blk, sel))
    got = np.bincount(np.concatenate(signalled), minlength=int(ptr[-1]))
    for r in ranks:
        builder.set_events(r, got[ptr[r]:ptr[r + 1]])
    return builder.freeze(dtype=dtype, events=events, nodes=nodes)


def only_ranks(blk: TaskBlock, sel: np.ndarray) -> TaskBlock:
    """The tasks of ``blk`` on the selected ranks, with their signals."""
    keep = sel[blk.rank]
    if keep.all():
        return blk
    sig_keep = np.repeat(keep, blk.sig_count)
    cols = {f.name: getattr(blk, f.name)[keep] for f in fields(TaskBlock)
            if f.name not in ("kind", "sig_rank", "sig_event")}
    return TaskBlock(kind=blk.kind, sig_rank=blk.sig_rank[sig_keep], sig_event=blk.sig_event[sig_keep],
                     **cols)


def ntiles(width: int, tiles: TileSpec) -> int:
    return int(ceil_div(width, tiles.column_tile(width)))


def task_block(kind: TaskKind, rank: np.ndarray, row0: np.ndarray, row1: np.ndarray, **cols) -> TaskBlock:
    """A ``TaskBlock`` with defaults: no peer, expert, columns, work, wait or signal."""
    n = len(rank)
    zeros = np.zeros(n, np.int64)
    sig_count = cols.pop("sig_count", np.ones(n, np.int64) if "sig_event" in cols else zeros)
    base = {"peer": rank, "expert": np.full(n, -1), "col0": zeros, "col1": zeros, "dst_row0": row0,
            "flops": zeros, "bytes": zeros, "link_bytes": zeros, "wait": np.full(n, -1),
            "sig_rank": rank if "sig_event" in cols else zeros[:0], "sig_event": zeros[:0]}
    base.update(cols)
    return TaskBlock(kind=kind, rank=rank, row0=row0, row1=row1, sig_count=sig_count, **base)


def col_tiles(width: int, tiles: TileSpec, parents: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parent, col0, col1) for every column tile of every parent."""
    cols = tiles.column_tile(width)
    parent, j = expand(np.full(parents, ntiles(width, tiles)))
    col0 = j * cols
    return parent, col0, np.minimum(col0 + cols, width)


def row_chunks(row0: np.ndarray, row1: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parent, chunk row0, chunk row1) splitting each [row0, row1) in chunks of ``rows``."""
    parent, j = expand(ceil_div(row1 - row0, rows))
    r0 = row0[parent] + j * rows
    return parent, r0, np.minimum(r0 + rows, row1[parent])


def gemm_weight_share(layout: Layout, rank: np.ndarray, expert: np.ndarray) -> np.ndarray:
    """1 / (blocks of the expert): the cost model counts an expert's weights once
    across its row blocks, as a cache holding them would."""
    return 1.0 / layout.blocks.per_expert[rank, expert]


def block_chunks(low: Lowering) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block id, chunk row0, chunk row1) of every row chunk of the selected GEMM blocks."""
    b = low.layout.blocks
    blk = np.flatnonzero(low.sel[b.rank])
    parent, r0, r1 = row_chunks(b.row0[blk], b.row1[blk], low.layout.tiles.rows)
    return blk[parent], r0, r1


def block_gemm(kind: TaskKind, low: Lowering, width: int, depth: int, wait: enum.IntEnum,
               signal: enum.IntEnum) -> TaskBlock:
    """GEMM tiles over every selected expert block: [rows, depth] @ [depth, width-tile];
    each waits on its block's ``wait`` event and signals its block's ``signal`` event.
    A block's input rows count once across its column tiles, the expert's weights once
    across its blocks."""
    b, ev = low.layout.blocks, low.events
    blk = np.flatnonzero(low.sel[b.rank])
    parent, col0, col1 = col_tiles(width, low.layout.tiles, len(blk))
    i = blk[parent]
    rank, m, n = b.rank[i], b.row1[i] - b.row0[i], col1 - col0
    weights = n * depth * gemm_weight_share(low.layout, rank, b.expert[i])
    inputs = m * depth / ntiles(width, low.layout.tiles)
    return task_block(kind, rank, b.row0[i], b.row1[i], expert=b.expert[i], col0=col0, col1=col1,
                      flops=2.0 * m * n * depth, bytes=(inputs + m * n + weights) * low.esize,
                      wait=ev.base(rank, wait) + b.local[i], sig_event=ev.base(rank, signal) + b.local[i])


def elementwise_chunks(kind: TaskKind, low: Lowering, rank: np.ndarray, row0: np.ndarray,
                       row1: np.ndarray, width: int, passes: int, flops: float, **cols) -> TaskBlock:
    """Row chunks of an elementwise op over ``width`` columns that does ``flops`` per
    element and reads or writes ``passes`` row-wide arrays (SwiGLU: 5 flops, 3 passes;
    its backward: 10 flops, 5 passes)."""
    m = row1 - row0
    return task_block(kind, rank, row0, row1, col1=np.full(len(rank), width), flops=flops * m * width,
                      bytes=passes * m * width * low.esize, **cols)


def put_columns(low: Lowering, i: np.ndarray, width: int | None = None) -> dict:
    """Work columns shared by every put of pieces ``i``: read and write each row once,
    and the rows cross the link when source and destination differ; ``width``: elements
    a row carries (None: H)."""
    p = low.layout.pieces
    nbytes = p.rows[i] * (width or low.layout.plan.moe.hidden) * low.esize
    return {"expert": p.expert[i], "bytes": 2 * nbytes,
            "link_bytes": np.where(p.src[i] != p.dst[i], nbytes, 0)}


def token_tiles(low: Lowering) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rank, tile index, row0, row1) of every token tile of the selected ranks."""
    layout = low.layout
    tpr, rows = layout.plan.par.tokens_per_rank, layout.tiles.rows
    rank, t = expand(np.where(low.sel, layout.token_tiles, 0))
    return rank, t, t * rows, np.minimum((t + 1) * rows, tpr)


def token_tile_sums(kind: TaskKind, low: Lowering, flops_per_term: float, wait: enum.IntEnum) -> TaskBlock:
    """One task per token tile summing each token's k expert rows (and the shared
    expert's) in fp32, after the tile's ``wait`` event: unpermute and its gradient."""
    moe = low.layout.plan.moe
    rank, t, r0, r1 = token_tiles(low)
    m = r1 - r0
    terms = moe.top_k + (1 if moe.shared_experts else 0)
    return task_block(kind, rank, r0, r1, col1=np.full(len(rank), moe.hidden),
                      flops=flops_per_term * terms * m * moe.hidden,
                      bytes=(terms + 1) * m * moe.hidden * low.esize, wait=low.events.base(rank, wait) + t)


def shared_block_rows(layout: Layout) -> np.ndarray:
    tpr, s = layout.plan.par.tokens_per_rank, layout.shared_rows
    r0 = np.arange(layout.shared_blocks) * s
    return np.minimum(r0 + s, tpr) - r0


def shared_blocks(low: Lowering) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rank, block, row0, row1) of the shared-expert row blocks of the selected ranks."""
    layout = low.layout
    rank, b = expand(np.where(low.sel, layout.shared_blocks, 0))
    r0 = b * layout.shared_rows
    return rank, b, r0, r0 + shared_block_rows(layout)[b]


def shared_chunks(low: Lowering) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rank, shared block, chunk row0, chunk row1) of every row chunk of the shared blocks."""
    rank, b, r0, r1 = shared_blocks(low)
    parent, c0, c1 = row_chunks(r0, r1, low.layout.tiles.rows)
    return rank[parent], b[parent], c0, c1


def shared_gemm(kind: TaskKind, low: Lowering, width: int, depth: int, wait: enum.IntEnum | None,
                signal: enum.IntEnum | None) -> TaskBlock:
    """GEMM tiles over every selected shared block: [rows, depth] @ [depth, width-tile]."""
    layout = low.layout
    rank, b, r0, r1 = shared_blocks(low)
    parent, col0, col1 = col_tiles(width, layout.tiles, len(rank))
    rank, b, r0, r1 = rank[parent], b[parent], r0[parent], r1[parent]
    m, n = r1 - r0, col1 - col0
    cols = {"col0": col0, "col1": col1, "flops": 2.0 * m * n * depth,
            "bytes": (m * depth / ntiles(width, layout.tiles) + m * n
                      + n * depth / max(layout.shared_blocks, 1)) * low.esize}
    if wait is not None:
        cols["wait"] = low.events.base(rank, wait) + b
    if signal is not None:
        cols["sig_event"] = low.events.base(rank, signal) + b
    return task_block(kind, rank, r0, r1, **cols)


def signal_token_tiles(blk: TaskBlock, low: Lowering, category: enum.IntEnum) -> TaskBlock:
    """``blk`` (tiles over token rows of their own rank) now signals ``category``'s
    event of every token tile its rows overlap."""
    rows = low.layout.tiles.rows
    first, last = blk.row0 // rows, (blk.row1 - 1) // rows
    parent, j = expand(last - first + 1)
    return replace(blk, sig_count=last - first + 1, sig_rank=blk.rank[parent],
                   sig_event=low.events.base(blk.rank[parent], category) + first[parent] + j)


# ------------------------------------------------------------------ every forward's expert phases
# Each reads its event categories by name from the region's enum (``low.events.categories``):
# ROWS, H, A one per GEMM block; SH, SA one per shared block; OUT one per token tile.

def gemm_up(low: Lowering) -> TaskBlock:
    e, moe = low.events.categories, low.layout.plan.moe
    return block_gemm(TaskKind.GEMM_UP, low, 2 * moe.ffn, moe.hidden, e.ROWS, e.H)


def swiglu(low: Lowering) -> TaskBlock:
    b, ev, e = low.layout.blocks, low.events, low.events.categories
    i, r0, r1 = block_chunks(low)
    moe = low.layout.plan.moe
    return elementwise_chunks(TaskKind.SWIGLU, low, b.rank[i], r0, r1, moe.ffn, passes=3,
                              flops=moe.glu.flops, expert=b.expert[i],
                              wait=ev.base(b.rank[i], e.H) + b.local[i],
                              sig_event=ev.base(b.rank[i], e.A) + b.local[i])


def shared_up(low: Lowering) -> TaskBlock:
    moe = low.layout.plan.moe
    sh = low.events.categories.SH
    return shared_gemm(TaskKind.SHARED_UP, low, 2 * moe.shared_ffn, moe.hidden, None, sh)


def shared_swiglu(low: Lowering) -> TaskBlock:
    rank, b, c0, c1 = shared_chunks(low)
    ev, e = low.events, low.events.categories
    return elementwise_chunks(TaskKind.SHARED_SWIGLU, low, rank, c0, c1, low.layout.plan.moe.shared_ffn,
                              passes=3, flops=5.0, wait=ev.base(rank, e.SH) + b,
                              sig_event=ev.base(rank, e.SA) + b)


def shared_down(low: Lowering) -> TaskBlock:
    """The shared experts' down GEMM tiles, each signalling the token tiles its rows overlap."""
    moe, e = low.layout.plan.moe, low.events.categories
    blk = shared_gemm(TaskKind.SHARED_DOWN, low, moe.hidden, moe.shared_ffn, e.SA, None)
    return signal_token_tiles(blk, low, e.OUT)


UP_PHASES = (gemm_up, swiglu)  # every forward's experts up to their activation
SHARED_PHASES = (shared_up, shared_swiglu, shared_down)  # every forward's shared experts


def signals_per_token_tile(blk: TaskBlock, low: Lowering, category: enum.IntEnum) -> np.ndarray:
    """Deprecated: how many signals of ``blk`` (built for rank 0 alone) reach each of rank
    0's token tiles of ``category`` (the lowering counts thresholds itself now)."""
    deprecated("regions.tiles.signals_per_token_tile", "lower_graph counts every threshold")
    return np.bincount(blk.sig_event - low.events.base(0, category), minlength=low.layout.token_tiles)

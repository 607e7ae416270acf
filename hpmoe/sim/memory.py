"""HBM traffic of every task: the L2 operands of GEMM tiles and the bytes that always reach HBM.

The replay (``hpmoe.sim.simulate``) runs one LRU cache per rank in the order tasks
actually start, and charges each task its misses plus its fixed bytes on the rank's
HBM, which every running task shares.  What a task touches:

- forward and data-gradient GEMM tiles (GEMM_UP, GEMM_DOWN, SHARED_UP, SHARED_DOWN and
  the DGRAD kinds), an m x n tile of depth k: two cached operands, the weight column
  tile (key: rank, kind, expert, columns; n * k elements) and the input row block (key:
  rank, kind, rows; m * k elements), plus the m x n output, written to HBM (fixed);
- weight-gradient GEMM tiles (the WGRAD kinds), dW[cols] (n x k) = G[rows, cols].T @
  A[rows] over an expert's m rows: two cached operands, the activation rows A (key:
  rank, kind, rows; m * k elements, reused by every column tile) and the gradient slice
  G (key: rank, kind, rows, columns; m * n elements), plus the n x k output (fixed);
- every other task: its ``bytes`` (read + written), not cached: vector tasks stream
  through memory; a remote put is charged half its bytes (the read at its source;
  the write lands on the peer, which is not charged).
Keys carry the kind: operands of different kinds are different tensors.

``compulsory`` bytes (fixed bytes plus every distinct operand once) are what any
schedule must move through a rank's HBM, whatever the cache: the memory lower bound.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..ir.graph import IS_PUT, TaskGraph, TaskKind
from .cost import free_tasks

WEIGHT_ROW_KINDS = (TaskKind.GEMM_UP, TaskKind.GEMM_DOWN, TaskKind.SHARED_UP, TaskKind.SHARED_DOWN,
                    TaskKind.DGRAD_DOWN, TaskKind.DGRAD_UP, TaskKind.SHARED_DGRAD_DOWN,
                    TaskKind.SHARED_DGRAD_UP)
WGRAD_KINDS = (TaskKind.WGRAD_DOWN, TaskKind.WGRAD_UP, TaskKind.SHARED_WGRAD_DOWN, TaskKind.SHARED_WGRAD_UP)
CACHED_KINDS = WEIGHT_ROW_KINDS + WGRAD_KINDS


@dataclass(frozen=True)
class MemoryTraffic:
    """HBM traffic of a graph's tasks.

    fixed: [n] bytes each task moves through HBM whatever the cache holds.
    operand: [n, 2] int64 id of each task's cached operands (-1: none).
    size: [keys] bytes of each operand.  key_rank: [keys] the rank that owns it.
    """

    fixed: np.ndarray
    operand: np.ndarray
    size: np.ndarray
    key_rank: np.ndarray

    def operand_bytes(self) -> np.ndarray:
        """[n] bytes of the task's cached operands (what it moves with no cache)."""
        sizes = np.append(self.size, 0.0)
        return sizes[self.operand].sum(axis=1)

    def compulsory(self, ep: int, rank: np.ndarray, capacity: float = np.inf) -> np.ndarray:
        """[ep] bytes any schedule moves through each rank's HBM with an L2 of ``capacity``
        bytes: the fixed bytes of its tasks (``rank``: [n] owner of each task), each
        distinct operand once, and every access again to an operand the L2 cannot hold."""
        fixed = np.bincount(rank, weights=self.fixed, minlength=ep)
        used = self.operand[self.operand >= 0]
        reads = np.bincount(used, minlength=len(self.size))
        times = np.where(self.size > capacity, reads, 1)
        return fixed + np.bincount(self.key_rank, weights=self.size * times, minlength=ep)

    def uncached(self, ep: int, rank: np.ndarray) -> np.ndarray:
        """[ep] bytes each rank moves with no cache at all."""
        return np.bincount(rank, weights=self.fixed + self.operand_bytes(), minlength=ep)


def memory_traffic(graph: TaskGraph, nbytes: np.ndarray | None = None) -> MemoryTraffic:
    """The traffic of every task of ``graph`` (see the module docstring); ``nbytes``: the
    bytes each uncached task's kernel moves (default: the lowering's ``bytes``)."""
    nbytes = graph.bytes if nbytes is None else nbytes
    esize = graph.dtype.itemsize
    free = free_tasks(graph)
    cached = np.isin(graph.kind, CACHED_KINDS) & ~free
    m = (graph.row1 - graph.row0).astype(np.float64)
    n = (graph.col1 - graph.col0).astype(np.float64)
    k = np.round(np.divide(graph.flops, 2.0 * m * n, out=np.zeros_like(m), where=m * n > 0))
    remote = IS_PUT[graph.kind] & (graph.link_bytes > 0)
    wgrad = np.isin(graph.kind, WGRAD_KINDS)
    out = np.where(wgrad, n * k, m * n) * esize
    fixed = np.where(cached, out, np.where(remote, nbytes / 2, nbytes))
    fixed = np.where(free, 0.0, fixed)
    i = np.flatnonzero(cached)
    keys, inverse, size_of = _operand_keys(graph, i, wgrad[i], m[i], n[i], k[i])
    size_of = size_of * esize
    size = np.zeros(len(keys))
    size[inverse] = size_of
    operand = np.full((graph.num_tasks, 2), -1, np.int64)
    operand[i, 0], operand[i, 1] = inverse[:len(i)], inverse[len(i):]
    return MemoryTraffic(fixed=fixed, operand=operand, size=size, key_rank=keys[:, 0].astype(np.int64))


def _operand_keys(graph: TaskGraph, i: np.ndarray, wgrad: np.ndarray, m: np.ndarray, n: np.ndarray,
                  k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unique keys [keys, 7], key index of each operand [2 len(i)]: first operands then
    second ones, elements of each operand [2 len(i)]) of the cached tasks ``i``.  Key:
    rank, kind, slot, expert, row0, row1, columns (col0 * 2**31 + col1), -1 where unused."""
    zeros = np.zeros(len(i), np.int64)
    rank, kind = graph.rank[i].astype(np.int64), graph.kind[i].astype(np.int64)
    row0, row1 = graph.row0[i].astype(np.int64), graph.row1[i].astype(np.int64)
    cols = graph.col0[i].astype(np.int64) * 2**31 + graph.col1[i].astype(np.int64)
    expert = graph.expert[i].astype(np.int64)
    # slot 0: the weight column tile, or (wgrad) the activation rows
    first = np.stack([rank, kind, zeros, np.where(wgrad, -1, expert), np.where(wgrad, row0, -1),
                      np.where(wgrad, row1, -1), np.where(wgrad, -1, cols)], 1)
    # slot 1: the input row block, or (wgrad) the gradient's rows x columns slice
    second = np.stack([rank, kind, zeros + 1, zeros - 1, row0, row1, np.where(wgrad, cols, -1)], 1)
    keys, inverse = np.unique(np.concatenate([first, second]), axis=0, return_inverse=True)
    size_of = np.concatenate([np.where(wgrad, m * k, n * k), np.where(wgrad, m * n, m * k)])
    return keys, inverse.reshape(-1), size_of


class LruCache:
    """A byte-capacity LRU of operand ids; ``access`` returns the bytes that missed.
    An operand larger than the whole cache is read from HBM and not kept."""

    def __init__(self, capacity: float):
        self.capacity, self.used = float(capacity), 0.0
        self.lines: OrderedDict[int, float] = OrderedDict()
        self.hits = self.misses = 0.0

    def access(self, key: int, size: float) -> float:
        lines = self.lines
        if key in lines:
            lines.move_to_end(key)
            self.hits += size
            return 0.0
        self.misses += size
        if size <= self.capacity:
            lines[key] = size
            self.used += size
            while self.used > self.capacity:
                self.used -= lines.popitem(last=False)[1]
        return size

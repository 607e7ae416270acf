"""Moving experts between ranks when a layer that stores only its own slots
(``RegionOptions.shard_experts``) takes a new placement: where each new row comes
from, the exchange itself, and its modelled cost (the planner's cost of moving).

Rank ``r`` stores the rows of its slots ``[r * S, (r + 1) * S)`` in slot order.  New
slot ``s`` reads logical expert ``new.phy2log[s]``: from its own rank's old rows when one
of them holds that expert (no traffic), else from the lowest rank that holds it (that
rank's first such row).  Every tensor keyed by the rows moves together — the weights,
their gradients, and any optimizer state shaped like them (Adam's moments) — packed
row by row into one byte buffer, so the move is one all-to-all over the session's
deadline-bounded collectives.  Its model (``Moves.seconds``): the busiest rank's row
copies at memory bandwidth, plus ``latency + max(bytes a rank sends or receives) /
bandwidth`` on the link.

An expert with replicas on several ranks has a row on each; ``replica_sum`` makes every
holder's gradient of it the sum over the holders (one all-gather in the backward, summed
in rank order, so the holders' rows and optimizer states stay bitwise equal).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .placement import Placement
from .sim.hardware import HardwareModel, LinkDirection


@dataclass(frozen=True)
class Moves:
    """``source[r][j] = (rank, row)``: the old stored row rank ``r``'s new row ``j`` is
    copied from (``rank == r``: a local copy)."""

    source: tuple[tuple[tuple[int, int], ...], ...]

    @staticmethod
    def between(old: Placement, new: Placement) -> Moves:
        """The rows each rank copies to go from ``old`` to ``new`` (same experts and ranks)."""
        if (old.experts, old.ranks) != (new.experts, new.ranks):
            raise ValueError(f"a move keeps the experts and ranks: {old.experts} experts on {old.ranks} "
                             f"ranks -> {new.experts} on {new.ranks}")
        held = [old.phy2log[r * old.slots_per_rank:(r + 1) * old.slots_per_rank] for r in range(old.ranks)]

        def source(rank: int, expert: int) -> tuple[int, int]:
            owner = rank if expert in held[rank] else min(q for q in range(old.ranks) if expert in held[q])
            return owner, held[owner].index(expert)

        per = new.slots_per_rank
        return Moves(tuple(tuple(source(r, e) for e in new.phy2log[r * per:(r + 1) * per])
                           for r in range(new.ranks)))

    @property
    def ranks(self) -> int:
        return len(self.source)

    def sent(self, src: int, dst: int) -> list[int]:
        """Old rows of ``src`` that ``dst`` receives, in the order of ``dst``'s new rows."""
        return [row for q, row in self.source[dst] if q == src] if src != dst else []

    def rows(self) -> np.ndarray:
        """[ranks, ranks] rows rank q sends rank r (zero diagonal)."""
        peers = range(self.ranks)
        return np.array([[len(self.sent(q, r)) for r in peers] for q in peers], np.int64)

    def seconds(self, row_bytes: int, hw: HardwareModel) -> float:
        """Modelled seconds of the move on ``hw``: the busiest rank's copies (each row it
        keeps, packs or unpacks read and written once at ``mem_bw``) plus one message per
        peer on the link, each rank sending and receiving at once, the busiest direction
        bound (no link time when nothing crosses ranks)."""
        rows = self.rows()
        copied = (np.array([len(s) for s in self.source]) + rows.sum(1)) * row_bytes  # kept + fetched, sent
        link = int(max(rows.sum(0).max(), rows.sum(1).max())) * row_bytes
        on_link = float(hw.put_time(link, self.ranks, LinkDirection.DISPATCH)) if link else 0.0
        return float(hw.memory_time(2 * copied.max())) + on_link


def row_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes one stored row carries over every tensor in ``tensors`` ([S, ...] each)."""
    return sum(t[0].numel() * t.element_size() for t in tensors)


def move_rows(tensors: list[torch.Tensor], moves: Moves, rank: int, coll: Any) -> list[torch.Tensor]:
    """This rank's new rows of every tensor in ``tensors`` ([S_old, ...] each), fresh
    [S_new, ...] tensors: rows it keeps copied in place, rows peers need packed (every
    tensor's row side by side as bytes) into one all-to-all over ``coll``
    (``runtime.collective.Collectives``), received rows unpacked; each row is copied
    once.  Collective: every rank of the group calls it with the same ``moves``."""
    peers, mine = range(moves.ranks), moves.source[rank]
    send = torch.tensor([row for r in peers for row in moves.sent(rank, r)], dtype=torch.int64)
    recv_counts = [len(moves.sent(q, rank)) for q in peers]
    send_counts = [len(moves.sent(rank, r)) for r in peers]
    packed = torch.cat([_as_bytes(t.index_select(0, send)) for t in tensors], 1)
    got = packed.new_empty((sum(recv_counts), packed.shape[1]))
    coll.all_to_all(got, packed, recv_counts, send_counts, "migrate: expert rows")
    kept = [j for j, (q, _) in enumerate(mine) if q == rank]
    fetched = sorted((j for j, (q, _) in enumerate(mine) if q != rank), key=lambda j: mine[j][0])  # received
    out, col = [], 0
    for t in tensors:
        new = t.new_empty((len(mine), *t.shape[1:]))
        new[kept] = t[[mine[j][1] for j in kept]]
        width = t[0].numel() * t.element_size()
        rows = got[:, col:col + width].flatten().clone()  # fresh storage: aligned for any dtype
        new[fetched] = rows.view(t.dtype).view(len(fetched), *t.shape[1:])
        out.append(new)
        col += width
    return out


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """[n, ...] rows as [n, bytes per row] uint8 (a view of a contiguous copy)."""
    return rows.contiguous().view(rows.shape[0], -1).view(torch.uint8)


@dataclass(frozen=True)
class Migration:
    """One move: ``rows`` [ranks, ranks] rows rank q sent rank r, ``row_bytes`` per row
    (weights, gradients and optimizer state together), ``seconds`` this rank measured
    (packing and the exchange), ``predicted_s`` the link model's (``Moves.seconds``)."""

    rows: np.ndarray
    row_bytes: int
    seconds: float
    predicted_s: float

    @staticmethod
    def nothing() -> Migration:
        return Migration(np.zeros((0, 0), np.int64), 0, 0.0, 0.0)

    @property
    def bytes(self) -> int:
        """Bytes that crossed ranks, all ranks together."""
        return int(self.rows.sum()) * self.row_bytes


def migrate(params: list[torch.nn.Parameter], moves: Moves, optimizer: torch.optim.Optimizer | None,
            coll: Any, hw: HardwareModel) -> Migration:
    """Move ``params`` ([S, ...] stored rows each), their gradients and every tensor of
    ``optimizer``'s state shaped like them to their new rows (``move_rows``), in place of
    the old ones (the parameter objects stay, so optimizers and hooks keep them).
    Collective; every rank must hold the same kinds of state (checked, naming them)."""
    start = time.perf_counter()
    tensors, put = _keyed_by_rows(params, optimizer)
    width = row_bytes(tensors)
    widths = coll.all_gather(torch.tensor([width], dtype=torch.int64), "migrate: row bytes").flatten()
    if len(set(widths.tolist())) != 1:
        raise ValueError(f"migrate: ranks carry different state per row (bytes per rank {widths.tolist()}): "
                         "every rank needs the same gradients and optimizer state")
    for set_to, t in zip(put, move_rows(tensors, moves, coll.rank, coll), strict=True):
        set_to(t)
    return Migration(moves.rows(), width, time.perf_counter() - start, moves.seconds(width, hw))


def _keyed_by_rows(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None
                   ) -> tuple[list[torch.Tensor], list[Any]]:
    """Every tensor that moves with the rows, and how to put its moved form back."""
    tensors, put = [], []
    for p in params:
        tensors.append(p.data)
        put.append(lambda t, p=p: setattr(p, "data", t))
        if p.grad is not None:
            tensors.append(p.grad)
            put.append(lambda t, p=p: setattr(p, "grad", t))
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                tensors.append(value)
                put.append(lambda t, state=state, key=key: state.__setitem__(key, t))
    return tensors, put


def replica_sum(stored: list[torch.Tensor], held: tuple[int, ...], replicated: tuple[int, ...],
                coll: Any) -> list[torch.Tensor]:
    """``stored`` ([S, ...] rows of logical experts ``held``) as they are, whose gradient
    rows of each expert in ``replicated`` become the sum over every rank's rows of it."""
    return list(_ReplicaSum.apply(coll, held, replicated, *stored))


class _ReplicaSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, coll: Any, held: tuple[int, ...], replicated: tuple[int, ...],
                *stored: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.coll, ctx.held, ctx.replicated = coll, held, replicated
        return tuple(t.view_as(t) for t in stored)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[Any, ...]:
        pick = [(j, ctx.replicated.index(e)) for j, e in enumerate(ctx.held) if e in ctx.replicated]
        parts = []
        for g in grads:
            part = g.new_zeros((len(ctx.replicated), *g.shape[1:]), dtype=torch.float32)
            for j, i in pick:
                part[i] += g[j].float()
            parts.append(part.flatten())
        total = ctx.coll.all_gather(torch.cat(parts), "backward: replica gradients").sum(0)
        out, col = [], 0
        for g, part in zip(grads, parts, strict=True):
            summed = total[col:col + part.numel()].view(len(ctx.replicated), *g.shape[1:]).to(g.dtype)
            g = g.clone()
            for j, i in pick:
                g[j] = summed[i]
            out.append(g)
            col += part.numel()
        return (None, None, None, *out)

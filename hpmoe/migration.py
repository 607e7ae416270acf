"""Moving experts between ranks when a layer that stores only its own slots
(``RegionOptions.shard_experts``) takes a new placement: where each new row comes
from, the exchange itself, and its modelled cost (the planner's cost of moving).

Rank ``r`` stores the rows of its slots ``[r * S, (r + 1) * S)`` in slot order.  New
slot ``s`` reads logical expert ``new.phy2log[s]``: from its own rank's old rows when one
of them holds that expert (no traffic), else from the lowest rank that holds it (that
rank's first such row).  Every tensor keyed by the rows moves with them, in place —
the weights, their gradients, and any optimizer state shaped like them (Adam's
moments) — one all-to-all per tensor over the session's deadline-bounded collectives,
all or none: each stage (``MoveStage``: the agreement, the all-to-all, the commit) is a
collective, and a rank writes its new rows only after every rank passed the commit, so
a peer lost in any stage ends the move with a ``MoveError`` naming it and every
surviving rank holding the rows of its old placement, still the layer's.
Its model (``Moves.seconds``): the busiest rank's row copies at memory bandwidth, plus
``latency`` per message and ``max(bytes a rank sends or receives) / bandwidth`` on the
link.  The planner keeps experts where they are (``plan_placement(current=...)``).

An expert with replicas on several ranks has a row on each; ``replica_sum`` makes every
holder's gradient of it the sum over the holders (one all-reduce in the backward, the
same bits on every rank, so the holders' rows and optimizer states stay bitwise equal);
``replica_seconds`` models what that costs a call.  A spare (a second slot of an expert
on its own rank) takes no tokens, sums nothing and is never a move's source.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import torch

from .comm import Collectives
from .placement import Placement
from .sim.hardware import HardwareModel, LinkDirection
from .spec import MoESpec


@dataclass(frozen=True)
class Moves:
    """``source[r][j] = (rank, row)``: the old stored row rank ``r``'s new row ``j`` is
    copied from (``rank == r``: a local copy)."""

    source: tuple[tuple[tuple[int, int], ...], ...]

    @staticmethod
    def between(old: Placement, new: Placement) -> Moves:
        """The rows each rank copies to go from ``old`` to ``new`` (same experts, ranks and
        slots)."""
        if (old.experts, old.ranks, old.slots) != (new.experts, new.ranks, new.slots):
            raise ValueError(f"a move keeps the experts, ranks and slots: {old.experts} experts on "
                             f"{old.ranks} ranks in {old.slots} slots -> {new.experts} on {new.ranks} in "
                             f"{new.slots}")
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

    def seconds(self, row_bytes: int, tensors: int, hw: HardwareModel) -> float:
        """Modelled seconds of the move (``move_rows``) on ``hw``: the busiest rank's
        copies at ``mem_bw`` (each row it sends, receives or shifts, read and written
        twice) plus one message per tensor on the link, each rank sending and receiving
        at once, the busiest direction bound (no link time when nothing crosses ranks)."""
        rows = self.rows()
        shifted = np.array([sum(q == r and row != j for j, (q, row) in enumerate(s))
                            for r, s in enumerate(self.source)])
        copied = (rows.sum(0) + rows.sum(1) + shifted) * row_bytes
        link = int(max(rows.sum(0).max(), rows.sum(1).max())) * row_bytes
        on_link = tensors * hw.link_latency + link / hw.link_bandwidth(self.ranks, LinkDirection.DISPATCH)
        return float(hw.memory_time(4 * copied.max())) + (float(on_link) if link else 0.0)


def adam_row(spec: MoESpec) -> tuple[int, int]:
    """(bytes, tensors) of one stored expert row while training with Adam — what a move
    carries: the weights (and biases) in ``spec.dtype``, an fp32 master copy where that
    dtype is narrower (mixed precision), and Adam's two fp32 moments."""
    params = 3 * spec.hidden * spec.ffn + (2 * spec.ffn + spec.hidden if spec.expert_bias else 0)
    narrow = spec.dtype.itemsize < 4
    per_param = spec.dtype.itemsize + 4 * narrow + 8
    return params * per_param, (4 if spec.expert_bias else 2) * (3 + narrow)


def row_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes one stored row carries over every tensor in ``tensors`` ([S, ...] each)."""
    return sum(t[0].numel() * t.element_size() for t in tensors)


class MoveStage(Enum):
    """The stages of a move, each one collective over the group: the agreement on what
    moves, the all-to-all of the rows, the commit after it.  A rank writes its new rows
    only once every rank has passed the commit."""

    AGREEMENT = "the agreement before the all-to-all"
    EXCHANGE = "the all-to-all of the rows"
    COMMIT = "the commit after the all-to-all"


class MoveError(RuntimeError):
    """A move that stopped in ``stage`` (a peer died, or missed the deadline): no row of
    this rank was written, so its rows are still those of the placement it had before
    the move, which stays the layer's placement."""

    def __init__(self, stage: MoveStage, cause: BaseException):
        super().__init__(f"move failed in {stage.value} ({stage.name}): no row was written, this rank keeps "
                         f"the rows of the placement it had before the move, which stays in effect; "
                         f"cause: {cause}")
        self.stage = stage


def _staged(stage: MoveStage, call: Callable[[], Any]) -> Any:
    """``call()``, any failure of it raised as a ``MoveError`` naming ``stage``."""
    try:
        return call()
    except RuntimeError as err:  # a CollectiveError, or the transport's own
        raise MoveError(stage, err) from err


def exchange_rows(tensors: list[torch.Tensor], moves: Moves, rank: int,
                  coll: Collectives) -> list[torch.Tensor | None]:
    """The rows rank ``rank`` receives for each tensor in ``tensors`` ([S, ...] its stored
    rows each), in the order of its new rows that come from peers (``MoveStage.EXCHANGE``:
    one all-to-all per tensor over ``coll``, nothing written); None for each when no row
    crosses ranks (the same on every rank)."""
    peers, mine = range(moves.ranks), moves.source[rank]
    if not moves.rows().any():
        return [None] * len(tensors)
    send = torch.tensor([row for r in peers for row in moves.sent(rank, r)], dtype=torch.int64,
                        device=tensors[0].device)
    recv_counts = [len(moves.sent(q, rank)) for q in peers]
    send_counts = [len(moves.sent(rank, r)) for r in peers]
    fetched = sum(q != rank for q, _ in mine)
    out = []
    for t in tensors:
        got = t.new_empty((fetched, *t.shape[1:]))
        _staged(MoveStage.EXCHANGE, lambda t=t, got=got: coll.all_to_all(
            got, t.index_select(0, send), recv_counts, send_counts, f"move: {MoveStage.EXCHANGE.value}"))
        out.append(got)
    return out


def write_rows(tensors: list[torch.Tensor], received: list[torch.Tensor | None], moves: Moves,
               rank: int) -> None:
    """Give every tensor its new rows in place (local, after the commit): rows kept at
    their index are not touched, rows kept at another index are copied there, rows from
    peers (``received``, ``exchange_rows``) land in theirs."""
    mine = moves.source[rank]
    fetched = sorted((j for j, (q, _) in enumerate(mine) if q != rank), key=lambda j: mine[j][0])
    shifted = [j for j, (q, row) in enumerate(mine) if q == rank and row != j]
    for t, got in zip(tensors, received, strict=True):
        local = t[[mine[j][1] for j in shifted]]  # copied before any row is overwritten
        if got is not None:
            t[fetched] = got
        t[shifted] = local


def move_rows(tensors: list[torch.Tensor], moves: Moves, rank: int, coll: Collectives) -> None:
    """Give every tensor in ``tensors`` ([S, ...] this rank's stored rows each) its new
    rows in place, all or none: the rows peers need leave in one all-to-all per tensor
    (``exchange_rows``), every rank passes the commit, then each writes (``write_rows``).
    A peer lost before the commit ends the move with a ``MoveError`` naming the stage and
    nothing written.  Collective: every rank calls it with the same ``moves`` and as many
    tensors."""
    received = exchange_rows(tensors, moves, rank, coll)
    commit = torch.ones(1, dtype=torch.int64, device="cpu")
    _staged(MoveStage.COMMIT, lambda: coll.all_gather(commit, f"move: {MoveStage.COMMIT.value}"))
    write_rows(tensors, received, moves, rank)


@dataclass(frozen=True)
class Migration:
    """One move: ``moves``; ``row_bytes`` per row over its ``tensors`` (weights,
    gradients and optimizer state together); ``seconds`` this rank measured (its copies
    and the exchanges); ``predicted_s`` the model's (``Moves.seconds``)."""

    moves: Moves
    row_bytes: int
    tensors: int
    seconds: float
    predicted_s: float

    @staticmethod
    def nothing() -> Migration:
        return Migration(Moves(()), 0, 0, 0.0, 0.0)

    @property
    def bytes(self) -> int:
        """Bytes that crossed ranks, all ranks together."""
        return int(self.moves.rows().sum()) * self.row_bytes


def migrate(params: list[torch.nn.Parameter], moves: Moves, optimizer: torch.optim.Optimizer | None,
            coll: Any, hw: HardwareModel) -> Migration:
    """Move ``params`` ([S, ...] stored rows each), their gradients and every tensor of
    ``optimizer``'s state shaped like them to their new rows, in place (``move_rows``:
    parameter objects and state tensors stay, so optimizers and hooks keep them).
    Collective; every rank must hold the same kinds of state (checked, naming them)."""
    start = time.perf_counter()
    tensors = keyed_by_rows(params, optimizer)
    width = row_bytes(tensors)
    mine = torch.tensor([width, len(tensors)], dtype=torch.int64, device="cpu")  # the session's gloo
    agreed = _staged(MoveStage.AGREEMENT, lambda: coll.all_gather(mine, f"move: {MoveStage.AGREEMENT.value}"))
    every = agreed.tolist()
    if any(other != every[0] for other in every):
        raise ValueError(f"migrate: ranks carry different state per row ((bytes, tensors) per rank {every}): "
                         "every rank needs the same gradients and optimizer state")
    move_rows(tensors, moves, coll.rank, coll)
    seconds = time.perf_counter() - start
    return Migration(moves, width, len(tensors), seconds, moves.seconds(width, len(tensors), hw))


def move_seconds(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None, moves: Moves,
                 hw: HardwareModel) -> float:
    """The modelled seconds ``migrate`` would take for ``moves`` of ``params`` and what
    moves with them (``keyed_by_rows``) on ``hw``."""
    tensors = keyed_by_rows(params, optimizer)
    return moves.seconds(row_bytes(tensors), len(tensors), hw)


def replica_seconds(params: list[torch.nn.Parameter], placement: Placement, hw: HardwareModel) -> float:
    """The modelled seconds one backward spends summing the gradient rows of the experts
    ``placement`` holds on several ranks (``replica_sum`` over ``params``, this rank's
    stored rows): a copy of every stored gradient at ``mem_bw``, and one all-reduce of the
    summed rows in fp32 (a ring: each rank sends and receives 2 (P - 1) / P of them)."""
    if not placement.spread:
        return 0.0
    summed = len(placement.spread) * sum(p[0].numel() for p in params) * 4
    ring = 2 * (placement.ranks - 1) / placement.ranks * summed
    copied = sum(p.numel() * p.element_size() for p in params) + 2 * summed
    link = hw.link_bandwidth(placement.ranks, LinkDirection.DISPATCH)
    return float(hw.memory_time(copied)) + hw.link_latency + ring / link


def keyed_by_rows(params: list[torch.nn.Parameter],
                  optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor that moves with the rows: each parameter, its gradient and its
    optimizer state shaped like it."""
    tensors = []
    for p in params:
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        tensors += [p.data, *([] if p.grad is None else [p.grad]),
                    *(v for v in state.values() if isinstance(v, torch.Tensor) and v.shape == p.shape)]
    return tensors


def replica_sum(stored: list[torch.Tensor], held: tuple[int, ...], replicated: tuple[int, ...],
                coll: Any) -> list[torch.Tensor]:
    """``stored`` ([S, ...] rows of logical experts ``held``) as they are, whose gradient
    rows of each expert in ``replicated`` become the sum over every rank's rows of it."""
    return list(_ReplicaSum.apply(coll, held, replicated, *stored))


class _ReplicaSum(torch.autograd.Function):
    """Forward: the stored tensors as they are (views).  Backward: each replicated
    expert's gradient rows summed on this rank in fp32, all-reduced, and written back
    into every row of it."""

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
        total = ctx.coll.all_reduce(torch.cat(parts), "backward: replica gradients")
        out, col = [], 0
        for g, part in zip(grads, parts, strict=True):
            summed = total[col:col + part.numel()].view(len(ctx.replicated), *g.shape[1:]).to(g.dtype)
            g = g.clone()
            for j, i in pick:
                g[j] = summed[i]
            out.append(g)
            col += part.numel()
        return (None, None, None, *out)

"""A layer's expert rows in logical expert order, for checkpoints.

A layer that stores every expert (the default) keeps its expert tensors in logical
order whatever its placement ([E, ...]; a slot reads its expert's row in place), so its
state dict is logical as it is.  A layer with ``shard_experts`` stores the rows of its
own slots ([S, ...] in slot order: replicas on several ranks, spares twice on one).  Its
state dict holds each expert tensor as a ``LogicalRows``: the logical [E, ...] tensor of
which this rank holds the rows of its own experts, one per expert, for
``torch.distributed.checkpoint`` (DCP) to save and load resharded — the row layout
torchrec and Megatron give DCP for shards of arbitrary rows, through DCP's checkpointable
protocol (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``).
An expert on several ranks is offered by each; DCP writes it once (its plans drop items
that more than one rank writes: the holders' rows are bitwise equal, ``replica_sum``).
Loading takes a ``LogicalRows`` of the layer's own experts (what DCP filled, at any EP
size, from any placement) or a plain [E, ...] tensor (a one-process checkpoint), and fills
every stored slot from its expert's row: nothing crosses ranks.

``BalanceState`` is what a checkpoint keeps of a layer's balance beside the rows: the
placement in effect, every rank's measured load and the call count — the same on every
rank, so DCP writes it once; ``restore`` adopts it (a sharded layer moves its rows, and
the optimizer's state with them, to the saved placement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..placement import Placement
from .balance import Balance, own_rows


class LogicalRows(torch.Tensor):
    """The logical [E, ...] tensor of a sharded layer, holding this rank's experts'
    rows only: ``rows[i]`` [1, ...] is expert ``experts[i]``'s (a view of the stored
    tensor).  Only DCP reads it; no torch operation runs on it."""

    rows: list[torch.Tensor]
    experts: tuple[int, ...]

    @staticmethod
    def __new__(cls, rows: list[torch.Tensor], experts: tuple[int, ...], shape: torch.Size) -> LogicalRows:
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=rows[0].dtype, device=rows[0].device)
        r.rows, r.experts = rows, experts
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise TypeError(f"{func} on a sharded layer's logical expert rows: they are for "
                        "torch.distributed.checkpoint (save and load them through DCP)")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"LogicalRows(shape={tuple(self.shape)}, dtype={self.dtype}, experts={self.experts})"

    def _chunks(self) -> list[ChunkStorageMetadata]:
        rest = (0,) * (len(self.shape) - 1)
        return [ChunkStorageMetadata(offsets=torch.Size((e, *rest)), sizes=r.shape)
                for e, r in zip(self.experts, self.rows, strict=True)]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.rows[0])
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props, size=self.shape))
                for c in self._chunks()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.rows[self.experts.index(index.offset[0])]


def logical_rows(stored: torch.Tensor, held: tuple[int, ...], experts: int) -> LogicalRows:
    """stored [S, ...] (rows of logical experts ``held``) -> the [experts, ...] logical
    tensor holding one row (a view) per distinct expert held, the first slot of each."""
    first = {e: j for j, e in reversed(list(enumerate(held)))}
    order = tuple(sorted(first))
    return LogicalRows([stored[first[e]:first[e] + 1] for e in order], order,
                       torch.Size((experts, *stored.shape[1:])))


def stored_rows(value: torch.Tensor, held: tuple[int, ...], experts: int, name: str) -> torch.Tensor:
    """[S, ...] the rows of experts ``held`` from ``value``: a ``LogicalRows`` holding
    every expert in ``held`` or a full [experts, ...] tensor; else raises naming ``name``."""
    if isinstance(value, LogicalRows):
        missing = sorted(set(held) - set(value.experts))
        if missing:
            raise ValueError(f"{name}: the logical rows hold experts {value.experts}, this rank stores "
                             f"{sorted(set(held))} (missing {missing})")
        return torch.cat([value.rows[value.experts.index(e)] for e in held])
    if value.shape[0] != experts:
        raise ValueError(f"{name}: a state dict's expert tensor is [experts={experts}, ...] in logical order "
                         f"(or DCP's logical rows), got shape {tuple(value.shape)}")
    return value[list(held)]


def held(balance: Balance) -> tuple[int, ...]:
    """The logical expert of each of this rank's slots under ``balance``'s placement (a
    layer with ``shard_experts`` stores their rows, in this order)."""
    return tuple(balance.physical().phy2log[own_rows(balance.spec, balance.options, balance.placement)])


def attach(module: nn.Module, balance: Balance, names: list[str]) -> None:
    """Make ``module``'s state dict logical: its sharded expert tensors ``names`` (names
    under the module) leave ``state_dict`` as ``LogicalRows`` and load from a
    ``LogicalRows`` or a full logical tensor (``stored_rows``)."""
    module.register_state_dict_post_hook(_Logical(balance, names, load=False))
    module.register_load_state_dict_pre_hook(_Logical(balance, names, load=True))


@dataclass
class _Logical:
    """``attach``'s state-dict hook (``load``: the load hook, else the save hook): an
    object, not a closure, so that a deep copy of the module reads its own balance (a
    closure would be shared, reading the original's placement)."""

    balance: Balance
    names: list[str]
    load: bool

    def __call__(self, mod: nn.Module, state: dict[str, Any], prefix: str, *rest: Any) -> None:
        slots, experts = held(self.balance), self.balance.spec.experts
        for key in (prefix + name for name in self.names):
            if not self.load:
                state[key] = logical_rows(state[key], slots, experts)
            elif key in state:
                state[key] = stored_rows(state[key], slots, experts, key)


# ---------------------------------------------------------------------------- balance


@dataclass(frozen=True)
class BalanceState:
    """A layer's balance in a checkpoint: ``phy2log`` of the placement in effect (None:
    the identity) for ``ranks`` ranks on ``nodes`` nodes, ``load`` [ranks, E] float64
    every rank's measured load, ``calls`` the region calls so far."""

    phy2log: tuple[int, ...] | None
    ranks: int
    nodes: int
    load: np.ndarray
    calls: int

    def placement(self, experts: int) -> Placement | None:
        return None if self.phy2log is None else Placement(self.phy2log, experts, self.ranks, self.nodes)


def balance_state(balance: Balance) -> BalanceState:
    """``balance``'s state; collective over a distributed layer's group (the loads)."""
    o, p = balance.options, balance.placement
    load = balance.load.cpu()
    session = balance._session()
    every = load.view(1, -1) if session is None else session.collectives.all_gather(load, "checkpoint: load")
    phy2log = None if p is None else p.phy2log
    return BalanceState(phy2log, o.ranks, o.nodes, every.numpy().copy(), balance.calls)


def restore(balance: Balance, state: BalanceState, stored: list[torch.Tensor],
            optimizer: torch.optim.Optimizer | None) -> None:
    """Adopt ``state``: its load (this rank's row when the group has as many processes
    as the saved one, else every rank the saved total over its own count) and call
    count, and its placement when the layer has its ranks, nodes and slots (a sharded
    layer moves its ``stored`` rows and ``optimizer``'s state there: collective)."""
    o, session = balance.options, balance._session()
    rank, procs = (0, 1) if session is None else (session.collectives.rank, session.collectives.world)
    load = torch.from_numpy(state.load)
    mine = load[rank] if load.shape[0] == procs else load.sum(0) / procs
    balance.load = mine.to(balance.load.device, torch.float64)
    balance.calls = state.calls
    placement = state.placement(balance.spec.experts)
    if not _fits(balance, placement, state):
        return  # the saved placement is for another layout: the layer keeps its own
    if o.shard_experts:
        balance.move_to(placement, stored, optimizer)
    else:
        balance.set(placement)


def _fits(balance: Balance, placement: Placement | None, state: BalanceState) -> bool:
    """Whether ``state``'s ``placement`` is for ``balance``'s ranks and nodes (and, for a
    sharded layer, its slots: a sharded layer's parameters keep their shape)."""
    o = balance.options
    slots = placement.slots if placement is not None else balance.spec.experts
    same = (state.ranks, state.nodes) == (o.ranks, o.nodes)
    return same and (not o.shard_experts or slots == balance.physical().slots)

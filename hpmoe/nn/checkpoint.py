"""Checkpoints of a model with hpmoe layers, saved and loaded through
``torch.distributed.checkpoint`` (DCP) in logical expert order.

Every layer's ``state_dict()`` is logical (``engine.checkpoint``): a layer that stores
every expert keeps them in logical order under any placement, and a sharded layer
(``shard_experts``) gives its rows as DCP's sharded rows of the logical tensor.  The
optimizer's state of a sharded layer's expert parameters is stored per slot as well;
``logical_optimizer`` makes ``optimizer.state_dict()`` (and so DCP's
``get_state_dict``) give it in the same logical rows.  ``TrainState`` is what to hand
DCP: the model, the optimizer and each layer's balance (``engine.checkpoint.BalanceState``):

    state = {"train": TrainState(model, optimizer)}
    dcp.save(state, checkpoint_id=path)     # every rank
    dcp.load(state, checkpoint_id=path)     # at any EP size, under any placement

A load restores the weights and the optimizer's state into the layer's placement of
the moment, then adopts the saved placement where the layer has the saved EP size and
nodes (a sharded layer moves its rows and their state there), so a resumed run computes
the bits the run that saved would have.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from ..engine.checkpoint import BalanceState, balance_state, held, logical_rows, restore, stored_rows
from .layer import MoE

_WRAPPERS = ("module.", "_orig_mod.")  # DDP's and torch.compile's prefixes, not part of a layer's name


def hpmoe_layers(model: nn.Module) -> dict[str, MoE]:
    """Every hpmoe layer of ``model`` by its name, wrappers' prefixes removed."""
    def name(n: str) -> str:
        return ".".join(part for part in n.split(".") if part + "." not in _WRAPPERS)

    return {name(n): m for n, m in model.named_modules() if isinstance(m, MoE)}


def _sharded_params(model: nn.Module) -> dict[torch.Tensor, MoE]:
    """Each expert parameter of a sharded layer of ``model``, with its layer."""
    return {p: m for m in hpmoe_layers(model).values() if m.options.shard_experts
            for p in m.experts.parameters()}


def _keyed(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[Any, torch.Tensor]:
    """The parameter each key of an optimizer state dict's ``state`` stands for: its
    groups' parameter keys (indices, or DCP's names) in the optimizer's groups' order."""
    keys = chain.from_iterable(g["params"] for g in state["param_groups"])
    return dict(zip(keys, chain.from_iterable(g["params"] for g in optimizer.param_groups), strict=True))


def _convert(optimizer: torch.optim.Optimizer, state: dict[str, Any], layers: dict[torch.Tensor, MoE],
             saving: bool) -> dict[str, Any]:
    """``state`` (an optimizer state dict) with the state tensors shaped like a sharded
    layer's expert parameter turned logical (``saving``) or back into its stored rows."""
    params, out = _keyed(optimizer, state), dict(state["state"])
    for key, entry in state["state"].items():
        p = params[key]
        layer = layers.get(p)
        if layer is None:
            continue
        slots, experts = held(layer._door.balance), layer.spec.experts
        out[key] = {k: (logical_rows(v, slots, experts) if saving else stored_rows(v, slots, experts, k))
                    if isinstance(v, torch.Tensor) and v.dim() and v.shape[1:] == p.shape[1:] else v
                    for k, v in entry.items()}
    return {**state, "state": out}


def logical_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer``'s state dict logical for the sharded layers of ``model`` (its
    expert parameters' state as ``LogicalRows`` out, stored rows in); once per optimizer."""
    if getattr(optimizer, "_hpmoe_logical", False):
        return
    optimizer._hpmoe_logical = True  # type: ignore[attr-defined]
    optimizer.register_state_dict_post_hook(lambda o, sd: _convert(o, sd, _sharded_params(model), True))
    optimizer.register_load_state_dict_pre_hook(lambda o, sd: _convert(o, sd, _sharded_params(model), False))


class TrainState(Stateful):
    """``model`` and ``optimizer`` as one DCP ``Stateful``: ``state_dict`` (collective
    over the EP groups of distributed layers) gives ``{"model", "optim", "balance"}``,
    DCP's own state dicts (``get_state_dict``) with logical experts and every hpmoe
    layer's ``BalanceState`` by name; ``load_state_dict`` sets them (``set_state_dict``)
    and adopts each layer's saved balance (``engine.checkpoint.restore``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        logical_optimizer(model, optimizer)

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        balance = {name: balance_state(m._door.balance) for name, m in hpmoe_layers(self.model).items()}
        return {"model": model_state, "optim": optim_state, "balance": balance}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        saved: dict[str, BalanceState] = state["balance"]
        for name, layer in hpmoe_layers(self.model).items():
            if name in saved:
                restore(layer._door.balance, saved[name], list(layer.experts.parameters()), self.optimizer)

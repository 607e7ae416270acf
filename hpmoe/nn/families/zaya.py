"""ZAYA1: a two-layer MLP router over the experts and one skip expert (its choice has weight 0
and no compute), fed the previous MoE layer's router state (the block's second argument) and
returning its own; softmax top-k with balancing biases for the choice; SwiGLU experts.  The
block returns ``(hidden, router state)``."""

from typing import Any

import torch
from torch import nn

from .base import Family


def _route(layer: nn.Module, x: torch.Tensor, hidden_states: torch.Tensor,
           prev_router_hidden_states: torch.Tensor | None = None) -> Any:
    """The router reads the [B, S, H] hidden states and the previous layer's router state."""
    return layer.gate(hidden_states, router_states=prev_router_hidden_states)


FAMILY = Family(
    name="zaya",
    module="transformers.models.zaya.modeling_zaya",
    block="ZayaSparseMoeBlock",
    config="ZayaConfig",
    model="ZayaForCausalLM",
    tiny=dict(num_experts=8, num_experts_per_tok=1, router_hidden_size=16),  # ZAYA routes to one expert
    route=_route,
    returns=3,
)

"""AFMoE (Trinity): sigmoid router (called on the block's [B, S, H] input) whose top-k choice
adds the block's expert bias, renormalised and times ``route_scale``; SwiGLU experts and
shared experts."""

from typing import Any

import torch
from torch import nn

from .base import Family


def _route(layer: nn.Module, x: torch.Tensor, hidden_states: torch.Tensor) -> Any:
    """The router reads the hidden states as the block received them, and its expert bias."""
    return layer.router(hidden_states, layer.expert_bias)


FAMILY = Family(
    name="afmoe",
    module="transformers.models.afmoe.modeling_afmoe",
    block="AfmoeSparseMoeBlock",
    config="AfmoeConfig",
    model="AfmoeForCausalLM",
    tiny=dict(
        num_experts=8,
        num_experts_per_tok=2,
        num_shared_experts=1,
        num_dense_layers=0,
        route_scale=2.5,
    ),
    router="router",
    shared="shared_experts",
    route=_route,
)

"""LFM2-MoE: sigmoid router whose top-k choice adds the block's expert bias (where
``use_expert_bias``), renormalised and times ``routed_scaling_factor``; SwiGLU experts (its
short convolutions are outside the block)."""

from typing import Any

import torch
from torch import nn

from .base import Family


def _route(layer: nn.Module, x: torch.Tensor, hidden_states: torch.Tensor) -> Any:
    """The router with the block's expert bias, or None where the block has none."""
    return layer.gate(x, getattr(layer, "expert_bias", None))


FAMILY = Family(
    name="lfm2_moe",
    module="transformers.models.lfm2_moe.modeling_lfm2_moe",
    block="Lfm2MoeSparseMoeBlock",
    config="Lfm2MoeConfig",
    model="Lfm2MoeForCausalLM",
    tiny=dict(
        num_experts=8,
        num_experts_per_tok=2,
        num_dense_layers=0,
        layer_types=["conv", "full_attention"],
        routed_scaling_factor=2.5,
    ),
    route=_route,
)

"""Cohere2-MoE: top-k over logits, softmax (or sigmoid, renormalised) over the k chosen;
SwiGLU experts; optional shared experts added to the routed sum, or averaged with it
(``shared_expert_combination_strategy="average"``: the region's sum halved)."""

from typing import Any

import torch
from torch import nn

from .base import Family


def _post(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, routed: Any) -> torch.Tensor:
    """The block's combination of the routed and the shared experts' outputs."""
    if layer.num_shared_experts > 0 and layer.shared_expert_combination_strategy == "average":
        return out / 2
    return out


FAMILY = Family(
    name="cohere2_moe",
    module="transformers.models.cohere2_moe.modeling_cohere2_moe",
    block="Cohere2MoeSparseMoeBlock",
    config="Cohere2MoeConfig",
    model="Cohere2MoeForCausalLM",
    tiny=dict(
        num_experts=8,
        num_experts_per_tok=2,
        num_shared_experts=1,
        shared_expert_combination_strategy="average",
        num_key_value_heads=2,
    ),
    shared="shared_experts",
    post=_post,
    block_attrs=("num_shared_experts", "shared_expert_combination_strategy"),
)

"""Laguna: sigmoid router (optionally soft-capped logits) whose top-k choice adds a
score-correction bias, renormalised; SwiGLU experts whose sum the block multiplies by
``routed_scaling_factor`` (the region folds it into the routing weights), plus an ungated
shared expert."""

from typing import Any

import torch
from torch import nn

from .base import Family


def routed_scale(layer: nn.Module, routed: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's (logits, weights, ids) with the weights times the block's
    ``routed_scaling_factor``, which the block applies to the routed experts' sum."""
    return routed[1] * layer.routed_scaling_factor, routed[2]


FAMILY = Family(
    name="laguna",
    module="transformers.models.laguna.modeling_laguna",
    block="LagunaSparseMoeBlock",
    config="LagunaConfig",
    model="LagunaForCausalLM",
    tiny=dict(
        num_experts=8,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=32,
        mlp_layer_types=["sparse"] * 2,
        moe_routed_scaling_factor=2.0,
        moe_router_logit_softcapping=5.0,
    ),
    shared="shared_experts",
    topk=routed_scale,
    block_attrs=("routed_scaling_factor",),
)

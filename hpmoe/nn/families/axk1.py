"""A.X-K1: DeepSeek-V3's block (sigmoid router with score-correction bias and group limits,
renormalised and times ``routed_scaling_factor``, SwiGLU experts, shared experts) with an
RMSNorm over its output (``post_mlp_layernorm``)."""

from typing import Any

import torch
from torch import nn

from .base import Family


def _post(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, routed: Any) -> torch.Tensor:
    """The block's RMSNorm over the routed and shared experts' sum."""
    return layer.post_mlp_layernorm(out)


FAMILY = Family(
    name="axk1",
    module="transformers.models.axk1.modeling_axk1",
    block="AXK1MoE",
    config="AXK1Config",
    model="AXK1ForCausalLM",
    tiny=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        mlp_layer_types=["sparse"] * 2,
        n_group=4,
        topk_group=2,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        head_dim=4,
        num_key_value_heads=2,
    ),
    shared="shared_experts",
    post=_post,
)

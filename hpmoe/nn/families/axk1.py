"""A.X-K1: DeepSeek-V3's block (sigmoid router with score-correction bias and group limits,
renormalised and times ``routed_scaling_factor``, SwiGLU experts, shared experts) with an
RMSNorm over its output (``post_mlp_layernorm``)."""

from typing import Any

import torch
from torch import nn

from .base import GROUPED_TINY, MLA_TINY, Family


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
        **MLA_TINY,
        **GROUPED_TINY,
        head_dim=4,
        num_key_value_heads=2,
    ),
    shared="shared_experts",
    post=_post,
)

"""Inkling: a sigmoid router over the routed and the shared experts (top-k of the routed
scores plus a score-correction bias for the choice; the chosen and the shared logits
normalised together, ``exp(logsigmoid - logsumexp)``, times ``route_scale * global_scale``);
SwiGLU routed experts, and shared experts (stacked [S, F, H]) each weighted per token by its
own router weight, run beside the region."""

from typing import Any

import torch
from torch import nn

from .base import Family


def _post(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, routed: Any) -> torch.Tensor:
    """The shared experts, weighted by the router's shared gammas (its fourth output)."""
    return out + layer.shared_experts(x, gammas=routed[3])


FAMILY = Family(
    name="inkling",
    module="transformers.models.inkling.modeling_inkling",
    block="InklingMoE",
    config="InklingTextConfig",
    model="InklingForCausalLM",
    tiny=dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, mlp_layer_types=["sparse"] * 2),
    post=_post,
)

"""Ernie-4.5-VL-MoE's modality sub-blocks (``Ernie4_5_VLMoeSparseMoeBlock``: the text and the
vision experts of each MoE layer are one each): fp32 softmax router, top-k of the scores plus
a score-correction bias, renormalised (the sum clamped below by ``moe_norm_min``); SwiGLU
experts.  The sub-block is called with the hidden states of its modality's tokens (flattened
to one dimension where the layer mixes modalities) and returns its output and router logits
flattened; the shared experts and the modality split (``Ernie4_5_VLMoeMoeBlock``) are
outside it."""

from typing import Any

import torch
from torch import nn

from .base import Family


def _route(layer: nn.Module, x: torch.Tensor, hidden_states: torch.Tensor) -> Any:
    """The router on x [N, H], its logits flattened as the sub-block returns them."""
    logits, weights, ids = layer.gate(x)
    return logits.flatten(), weights, ids


FAMILY = Family(
    name="ernie4_5_vl_moe",
    module="transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe",
    block="Ernie4_5_VLMoeSparseMoeBlock",
    config="Ernie4_5_VLMoeTextConfig",
    model="Ernie4_5_VLMoeTextModel",
    # one MoE layer: its text and vision sub-blocks are the two blocks
    tiny=dict(moe_num_experts=8, moe_k=2, moe_num_shared_experts=1, moe_intermediate_size=[16, 8],
              mlp_layer_types=["dense", "sparse"],
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[3, 3, 2])),
    route=_route,
    returns=0,
)

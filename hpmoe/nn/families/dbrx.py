"""DBRX: softmax router whose top-k weights the block divides by their p-norm
(``moe_normalize_expert_weights``; the block's own ``route_tokens_to_experts`` runs), SwiGLU
experts as flat ``w1`` (gate), ``v1`` (up), ``w2`` (down) tensors of [E * F, H]."""

from typing import Any

import torch
from torch import nn

from .base import ExpertsLayout, Family


def _topk(layer: nn.Module, logits: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The router returns logits; the block's method routes them (reading ``top_k`` and
    ``moe_normalize_expert_weights``, copied to the layer)."""
    return FAMILY.block_class().route_tokens_to_experts(layer, logits)


FAMILY = Family(
    name="dbrx",
    module="transformers.models.dbrx.modeling_dbrx",
    block="DbrxFFN",
    config="DbrxConfig",
    model="DbrxForCausalLM",
    tiny=dict(d_model=32, n_heads=2, n_layers=2, max_seq_len=64,
              attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0),
              ffn_config=dict(ffn_hidden_size=16, moe_num_experts=8, moe_top_k=2)),
    router="router",
    layout=ExpertsLayout.FLAT,
    topk=_topk,
    block_attrs=("top_k", "moe_normalize_expert_weights"),
)

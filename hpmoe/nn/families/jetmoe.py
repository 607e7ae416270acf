"""JetMoE (its MoE-FFN, ``JetMoeMoE``): softmax over the top-k logits, SwiGLU experts as
parallel linears (``input_linear`` [E, 2F, H], ``output_linear`` [E, H, F]) and one output
bias shared by every token.  Its attention experts (``JetMoeMoA``) are not an MoE-FFN
region: they stay transformers' own."""

from typing import Any

import torch
from torch import nn

from .base import ExpertsLayout, Family


def _topk(layer: nn.Module, routed: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The router returns its choice sorted by expert (positions ``token * k + slot``, the
    gates in that order, rows per expert, logits): put it back into [N, k] top-k order."""
    order, _, gates, sizes, _ = routed
    k = layer.router.top_k
    experts = torch.arange(len(sizes), device=order.device).repeat_interleave(
        torch.tensor(sizes, device=order.device))
    ids = torch.empty_like(order).scatter_(0, order, experts).view(-1, k)
    weights = torch.zeros_like(gates).scatter(0, order, gates).view(-1, k)
    return weights, ids


FAMILY = Family(
    name="jetmoe",
    module="transformers.models.jetmoe.modeling_jetmoe",
    block="JetMoeMoE",
    config="JetMoeConfig",
    model="JetMoeForCausalLM",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2, kv_channels=16),
    router="router",
    layout=ExpertsLayout.PARALLEL,
    topk=_topk,
    output_bias="bias",
)

"""Mellum: softmax top-k router (renormalised where ``norm_topk_prob``), SwiGLU experts."""

from .base import Family

FAMILY = Family(
    name="mellum",
    module="transformers.models.mellum.modeling_mellum",
    block="MellumSparseMoeBlock",
    config="MellumConfig",
    model="MellumForCausalLM",
    tiny=dict(num_experts=8, num_experts_per_tok=2, mlp_layer_types=["sparse"] * 2),
)

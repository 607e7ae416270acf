"""Qwen3-VL-MoE text blocks: softmax top-k router, renormalised, SwiGLU experts."""

from .base import Family

FAMILY = Family(
    name="qwen3_vl_moe",
    module="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
    block="Qwen3VLMoeTextSparseMoeBlock",
    config="Qwen3VLMoeTextConfig",
    model="Qwen3VLMoeTextModel",
    tiny=dict(num_experts=8, num_experts_per_tok=2),
)

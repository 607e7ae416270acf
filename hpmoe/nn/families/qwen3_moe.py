"""Qwen3-MoE: softmax top-k router (optionally renormalised), SwiGLU experts."""

from .base import Family

FAMILY = Family(
    name="qwen3_moe",
    module="transformers.models.qwen3_moe.modeling_qwen3_moe",
    block="Qwen3MoeSparseMoeBlock",
    config="Qwen3MoeConfig",
    model="Qwen3MoeForCausalLM",
    tiny=dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
)

"""Qwen3.5-MoE: softmax top-k router, renormalised; SwiGLU experts; a shared expert scaled
by sigmoid(shared_expert_gate(x)) (its gated-delta-net attention is outside the block)."""

from .base import Family

FAMILY = Family(
    name="qwen3_5_moe",
    module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    block="Qwen3_5MoeSparseMoeBlock",
    config="Qwen3_5MoeTextConfig",
    model="Qwen3_5MoeForCausalLM",
    tiny=dict(
        num_experts=8,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=24,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
    ),
    shared="shared_expert",
    shared_gate="shared_expert_gate",
)

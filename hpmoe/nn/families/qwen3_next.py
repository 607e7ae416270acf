"""Qwen3-Next: softmax top-k router; a shared expert scaled by sigmoid(shared_expert_gate(x))."""

from .base import Family

FAMILY = Family(
    name="qwen3_next",
    module="transformers.models.qwen3_next.modeling_qwen3_next",
    block="Qwen3NextSparseMoeBlock",
    config="Qwen3NextConfig",
    model="Qwen3NextForCausalLM",
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

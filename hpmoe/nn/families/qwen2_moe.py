"""Qwen2-MoE: softmax top-k router; a shared expert scaled by sigmoid(shared_expert_gate(x))."""

from .base import Family

FAMILY = Family(
    name="qwen2_moe",
    module="transformers.models.qwen2_moe.modeling_qwen2_moe",
    block="Qwen2MoeSparseMoeBlock",
    config="Qwen2MoeConfig",
    model="Qwen2MoeForCausalLM",
    tiny=dict(
        num_experts=8,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=24,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    shared="shared_expert",
    shared_gate="shared_expert_gate",
)

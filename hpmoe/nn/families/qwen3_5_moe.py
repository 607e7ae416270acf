"""Qwen3.5-MoE: softmax top-k router, renormalised; SwiGLU experts; a shared expert scaled
by sigmoid(shared_expert_gate(x)) (its gated-delta-net attention is outside the block)."""

from .base import GATED_DELTA_TINY, Family

FAMILY = Family(
    name="qwen3_5_moe",
    module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    block="Qwen3_5MoeSparseMoeBlock",
    config="Qwen3_5MoeTextConfig",
    model="Qwen3_5MoeForCausalLM",
    tiny=dict(
        **GATED_DELTA_TINY,
    ),
    shared="shared_expert",
    shared_gate="shared_expert_gate",
)

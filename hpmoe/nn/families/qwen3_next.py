"""Qwen3-Next: softmax top-k router; a shared expert scaled by sigmoid(shared_expert_gate(x))."""

from .base import GATED_DELTA_TINY, Family

FAMILY = Family(
    name="qwen3_next",
    module="transformers.models.qwen3_next.modeling_qwen3_next",
    block="Qwen3NextSparseMoeBlock",
    config="Qwen3NextConfig",
    model="Qwen3NextForCausalLM",
    tiny=dict(
        **GATED_DELTA_TINY,
    ),
    shared="shared_expert",
    shared_gate="shared_expert_gate",
)

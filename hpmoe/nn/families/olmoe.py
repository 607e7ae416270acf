"""OLMoE: softmax top-k router, SwiGLU experts."""

from .base import Family

FAMILY = Family(
    name="olmoe",
    module="transformers.models.olmoe.modeling_olmoe",
    block="OlmoeSparseMoeBlock",
    config="OlmoeConfig",
    model="OlmoeForCausalLM",
    tiny=dict(num_experts=8, num_experts_per_tok=2),
)

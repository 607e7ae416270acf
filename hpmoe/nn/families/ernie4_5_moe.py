"""Ernie-4.5-MoE: fp32 softmax router with a score-correction bias, optional shared experts."""

from .base import Family

FAMILY = Family(
    name="ernie4_5_moe",
    module="transformers.models.ernie4_5_moe.modeling_ernie4_5_moe",
    block="Ernie4_5_MoeSparseMoeBlock",
    config="Ernie4_5_MoeConfig",
    model="Ernie4_5_MoeForCausalLM",
    tiny=dict(
        moe_num_experts=8, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=0, moe_layer_interval=1
    ),
    shared="shared_experts",
)

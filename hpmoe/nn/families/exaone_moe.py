"""EXAONE-MoE: DeepSeek-V3-style sigmoid router (score-correction bias for the choice, group
limits, renormalised, times ``routed_scaling_factor``), SwiGLU experts, shared experts (its
sliding-window attention is outside the block)."""

from .base import Family

FAMILY = Family(
    name="exaone_moe",
    module="transformers.models.exaone_moe.modeling_exaone_moe",
    block="ExaoneMoeSparseMoEBlock",
    config="ExaoneMoeConfig",
    model="ExaoneMoeForCausalLM",
    tiny=dict(
        num_experts=8,
        num_experts_per_tok=2,
        num_shared_experts=1,
        mlp_layer_types=["sparse"] * 2,
        n_group=4,
        topk_group=2,
        num_key_value_heads=2,
    ),
    shared="shared_experts",
)

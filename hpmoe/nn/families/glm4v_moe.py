"""GLM-4.5V / 4.6V text blocks: DeepSeek-V3-style sigmoid router (score-correction bias for
the choice, group limits, renormalised, times ``routed_scaling_factor``), SwiGLU experts,
shared experts (its vision tower is outside the block)."""

from .base import Family

FAMILY = Family(
    name="glm4v_moe",
    module="transformers.models.glm4v_moe.modeling_glm4v_moe",
    block="Glm4vMoeTextMoE",
    config="Glm4vMoeTextConfig",
    model="Glm4vMoeTextModel",
    tiny=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=0,
        n_group=4,
        topk_group=2,
        num_key_value_heads=2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]),
    ),
    shared="shared_experts",
)

"""GLM-4-MoE-Lite: DeepSeek-V3-style sigmoid router (score-correction bias
for the choice, group limits, renormalised, times ``routed_scaling_factor``), SwiGLU
experts, shared experts (its MLA attention is outside the block)."""

from .base import GROUPED_TINY, MLA_TINY, Family

FAMILY = Family(
    name="glm4_moe_lite",
    module="transformers.models.glm4_moe_lite.modeling_glm4_moe_lite",
    block="Glm4MoeLiteMoE",
    config="Glm4MoeLiteConfig",
    model="Glm4MoeLiteForCausalLM",
    tiny=dict(
        **MLA_TINY,
        **GROUPED_TINY,
        head_dim=8,
        num_key_value_heads=2,
    ),
    shared="shared_experts",
)

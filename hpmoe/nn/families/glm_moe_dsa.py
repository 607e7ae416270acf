"""GLM-5 (GLM-MoE-DSA): DeepSeek-V3-style sigmoid router (score-correction bias for the
choice, group limits, renormalised, times ``routed_scaling_factor``), SwiGLU experts, shared
experts (its sparse (indexed) attention is outside the block)."""

from .base import GROUPED_TINY, MLA_TINY, Family

FAMILY = Family(
    name="glm_moe_dsa",
    module="transformers.models.glm_moe_dsa.modeling_glm_moe_dsa",
    block="GlmMoeDsaMoE",
    config="GlmMoeDsaConfig",
    model="GlmMoeDsaForCausalLM",
    tiny=dict(
        **MLA_TINY,
        **GROUPED_TINY,
        head_dim=8,
        num_key_value_heads=2,
        index_topk=8,
        index_head_dim=8,
        index_n_heads=2,
    ),
    shared="shared_experts",
)

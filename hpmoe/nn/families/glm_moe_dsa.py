"""GLM-5 (GLM-MoE-DSA): DeepSeek-V3-style sigmoid router (score-correction bias for the
choice, group limits, renormalised, times ``routed_scaling_factor``), SwiGLU experts, shared
experts (its sparse (indexed) attention is outside the block)."""

from .base import Family

FAMILY = Family(
    name="glm_moe_dsa",
    module="transformers.models.glm_moe_dsa.modeling_glm_moe_dsa",
    block="GlmMoeDsaMoE",
    config="GlmMoeDsaConfig",
    model="GlmMoeDsaForCausalLM",
    tiny=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        mlp_layer_types=["sparse"] * 2,
        n_group=4,
        topk_group=2,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        head_dim=8,
        num_key_value_heads=2,
        index_topk=8,
        index_head_dim=8,
        index_n_heads=2,
    ),
    shared="shared_experts",
)

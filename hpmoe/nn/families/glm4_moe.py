"""GLM-4-MoE: DeepSeek-V3-style sigmoid router, shared experts."""

from .base import Family

FAMILY = Family(
    name="glm4_moe",
    module="transformers.models.glm4_moe.modeling_glm4_moe",
    block="Glm4MoeMoE",
    config="Glm4MoeConfig",
    model="Glm4MoeForCausalLM",
    tiny=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=0,
        n_group=4,
        topk_group=2,
    ),
    shared="shared_experts",
)

"""DeepSeek-V3: sigmoid router with score-correction bias and group limits, shared experts."""

from .base import Family

FAMILY = Family(
    name="deepseek_v3",
    module="transformers.models.deepseek_v3.modeling_deepseek_v3",
    block="DeepseekV3MoE",
    config="DeepseekV3Config",
    model="DeepseekV3ForCausalLM",
    tiny=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=0,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        head_dim=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
    shared="shared_experts",
)

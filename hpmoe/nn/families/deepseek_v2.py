"""DeepSeek-V2: softmax router (greedy or group-limited), scaled weights, shared experts."""

from .base import Family

FAMILY = Family(
    name="deepseek_v2",
    module="transformers.models.deepseek_v2.modeling_deepseek_v2",
    block="DeepseekV2Moe",
    config="DeepseekV2Config",
    model="DeepseekV2ForCausalLM",
    tiny=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        first_k_dense_replace=0,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    ),
    shared="shared_experts",
)

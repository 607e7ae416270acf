"""Kimi-Linear: DeepSeek-V3-style sigmoid router with score-correction bias, renormalised
and scaled, shared experts; ``first_k_dense_replace`` layers are dense (its linear
attention is outside the block)."""

from .base import Family

FAMILY = Family(
    name="kimi_linear",
    module="transformers.models.kimi_linear.modeling_kimi_linear",
    block="KimiLinearMoE",
    config="KimiLinearConfig",
    model="KimiLinearForCausalLM",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, mlp_layer_types=["sparse"] * 2,
              layer_types=["linear_attention", "full_attention"], kv_lora_rank=8, q_lora_rank=None,
              qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=4, topk_group=2,
              linear_head_dim=8, linear_num_heads=2, norm_topk_prob=True),
    shared="shared_experts",
)

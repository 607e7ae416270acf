"""Mistral Large 4 text blocks: Mistral 4's group-limited softmax router (logits in fp32,
always renormalised, times ``routed_scaling_factor``), SwiGLU experts and shared experts
(its indexed sparse attention and KV sharing are outside the block)."""

from .base import Family

FAMILY = Family(
    name="mistral_large4",
    module="transformers.models.mistral_large4.modeling_mistral_large4",
    block="MistralLarge4TextMoE",
    config="MistralLarge4TextConfig",
    model="MistralLarge4TextModel",
    tiny=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=0,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        head_dim=8,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        index_topk=8,
        index_head_dim=8,
        index_n_heads=2,
        num_key_value_heads=2,
    ),
    shared="shared_experts",
)

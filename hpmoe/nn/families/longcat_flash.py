"""LongCat-Flash: refused — its router also routes to zero-computation experts (the
token itself, scaled by its weight), which the region has no task for."""

from .base import Family

FAMILY = Family(
    name="longcat_flash",
    module="transformers.models.longcat_flash.modeling_longcat_flash",
    block="LongcatFlashMoE",
    config="LongcatFlashConfig",
    model="LongcatFlashForCausalLM",
    tiny=dict(num_layers=1, n_routed_experts=8, moe_topk=2, zero_expert_num=2, expert_ffn_hidden_size=16,
              ffn_hidden_size=16, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
              v_head_dim=8, head_dim=4),
    router="router",
    refused="zero-computation experts (zero_expert_num: identity experts the router also picks)",
)

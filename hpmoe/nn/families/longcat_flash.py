"""LongCat-Flash: softmax router over the routed and the zero-computation experts (ids past
the routed ones: the token itself, times its weight), a score-correction bias for the
choice only, weights times ``routed_scaling_factor``; SwiGLU experts (gate_up_proj holds rows
for every expert id, the routed ones compute)."""

from .base import Family

FAMILY = Family(
    name="longcat_flash",
    module="transformers.models.longcat_flash.modeling_longcat_flash",
    block="LongcatFlashMoE",
    config="LongcatFlashConfig",
    model="LongcatFlashForCausalLM",
    tiny=dict(num_hidden_layers=4, n_routed_experts=8, moe_topk=2, zero_expert_num=2,
              expert_ffn_hidden_size=16, ffn_hidden_size=16, kv_lora_rank=8, q_lora_rank=8,
              qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4),
    router="router",
    identity_experts="zero_expert_num",
)

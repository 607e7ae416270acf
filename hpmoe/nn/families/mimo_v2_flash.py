"""MiMo-V2-Flash: DeepSeek-V3-style sigmoid router (score-correction bias for the choice,
group limits, renormalised, times ``routed_scaling_factor``), SwiGLU experts (its hybrid
sliding-window attention is outside the block)."""

from .base import Family

FAMILY = Family(
    name="mimo_v2_flash",
    module="transformers.models.mimo_v2_flash.modeling_mimo_v2_flash",
    block="MiMoV2FlashMoE",
    config="MiMoV2FlashConfig",
    model="MiMoV2FlashForCausalLM",
    tiny=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        mlp_layer_types=["sparse"] * 2,
        n_group=4,
        topk_group=2,
        v_head_dim=16,
        rope_parameters={t: dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
                               for t in ("full_attention", "sliding_attention")},
    ),
)

"""Hy3: sigmoid router whose top-k choice adds the block's score-correction bias
(a buffer of the block, passed to the router), renormalised and times
``router_scaling_factor``; SwiGLU experts, shared experts (summed in fp32 where
``enable_moe_fp32_combine``; the region sums in fp32)."""

from .base import Family

FAMILY = Family(
    name="hy_v3",
    module="transformers.models.hy_v3.modeling_hy_v3",
    block="HYV3MoE",
    config="HYV3Config",
    model="HYV3ForCausalLM",
    tiny=dict(num_experts=8, num_experts_per_tok=2, num_shared_experts=1, mlp_layer_types=["sparse"] * 2),
    router_args=("e_score_correction_bias",),
    shared="shared_experts",
)

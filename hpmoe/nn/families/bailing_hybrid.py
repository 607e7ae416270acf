"""Bailing-hybrid (Ling): DeepSeek-V3-style sigmoid router (score-correction bias for
the choice, group limits, renormalised, times ``routed_scaling_factor``), SwiGLU experts,
shared experts (its linear attention is outside the block).  Since transformers 5.25 its
experts may clamp after the activation as Step-3.7's do (``swiglu_limits``): a layer that
does is refused, its shared MLP (clamped by ``swiglu_limits_shared``) runs beside the region."""

from .base import MLA_TINY, Family
from .step3p7 import plain_unless_clamped

FAMILY = Family(
    name="bailing_hybrid",
    module="transformers.models.bailing_hybrid.modeling_bailing_hybrid",
    block="BailingHybridMoE",
    config="BailingHybridConfig",
    model="BailingHybridForCausalLM",
    tiny=dict(
        **MLA_TINY,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        mlp_layer_types=["sparse"] * 2,
        n_group=4,
        topk_group=2,
        head_dim=8,
        num_key_value_heads=2,
        layer_group_size=2,
    ),
    shared="shared_experts",
    glu=plain_unless_clamped("bailing_hybrid"),
)

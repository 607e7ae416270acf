"""Lara-mini: softmax top-k router (fp32 logits, renormalised where ``norm_topk_prob``), SwiGLU
experts and an ungated shared expert (its linear attention is outside the block)."""

from .base import Family

FAMILY = Family(
    name="lara_mini",
    module="transformers.models.lara_mini.modeling_lara_mini",
    block="LaraMiniSparseMoeBlock",
    config="LaraMiniConfig",
    model="LaraMiniForCausalLM",
    tiny=dict(
        num_experts=8,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=32,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
    ),
    shared="shared_expert",
)

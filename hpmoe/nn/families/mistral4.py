"""Mistral 4: softmax router with group limits (the top-2 sum per group picks
``topk_group`` groups), renormalised and times ``routed_scaling_factor``; SwiGLU experts and
shared experts (its MLA attention is outside the block)."""

from .base import MLA_TINY, Family

FAMILY = Family(
    name="mistral4",
    module="transformers.models.mistral4.modeling_mistral4",
    block="Mistral4MoE",
    config="Mistral4Config",
    model="Mistral4ForCausalLM",
    tiny=dict(
        **MLA_TINY,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=0,
        head_dim=8,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    ),
    shared="shared_experts",
)

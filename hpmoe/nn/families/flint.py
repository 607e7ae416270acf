"""Flint: sigmoid top-k router without bias (fp32 logits, renormalised where
``norm_topk_prob``), SwiGLU experts and an ungated shared expert."""

from .base import Family

FAMILY = Family(
    name="flint",
    module="transformers.models.flint.modeling_flint",
    block="FlintSparseMoeBlock",
    config="FlintConfig",
    model="FlintForCausalLM",
    tiny=dict(num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=32, mlp_only_layers=[]),
    shared="shared_expert",
)

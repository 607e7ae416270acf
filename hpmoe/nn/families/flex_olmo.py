"""FlexOlmo: softmax top-k router (not renormalised by default), SwiGLU experts."""

from .base import Family

FAMILY = Family(
    name="flex_olmo",
    module="transformers.models.flex_olmo.modeling_flex_olmo",
    block="FlexOlmoSparseMoeBlock",
    config="FlexOlmoConfig",
    model="FlexOlmoForCausalLM",
    tiny=dict(num_experts=8, num_experts_per_tok=2),
)

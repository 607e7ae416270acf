"""GraniteMoE: top-k over logits, softmax over the k chosen; the router is ``router``."""

from .base import Family

FAMILY = Family(
    name="granitemoe",
    module="transformers.models.granitemoe.modeling_granitemoe",
    block="GraniteMoeMoE",
    config="GraniteMoeConfig",
    model="GraniteMoeForCausalLM",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2),
    router="router",
)

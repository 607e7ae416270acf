"""GraniteMoE-SWA: GraniteMoE's block (top-k over logits, softmax over the k chosen); its
shared MLP is outside the block."""

from .base import Family

FAMILY = Family(
    name="granitemoe_swa",
    module="transformers.models.granitemoe_swa.modeling_granitemoe_swa",
    block="GraniteMoeSWAMoE",
    config="GraniteMoeSWAConfig",
    model="GraniteMoeSWAForCausalLM",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=16),
    router="router",
)

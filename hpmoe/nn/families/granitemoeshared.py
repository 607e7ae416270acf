"""GraniteMoE with a shared MLP: the shared MLP belongs to the decoder layer, beside the
block, and stays as it is; the block is GraniteMoE's."""

from .base import Family

FAMILY = Family(
    name="granitemoeshared",
    module="transformers.models.granitemoeshared.modeling_granitemoeshared",
    block="GraniteMoeSharedMoE",
    config="GraniteMoeSharedConfig",
    model="GraniteMoeSharedForCausalLM",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=24),
    router="router",
)

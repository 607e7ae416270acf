"""Granite-4 (GraniteMoE-Hybrid): GraniteMoE's block (top-k over logits, softmax over the k
chosen); its shared MLP and Mamba layers are outside the block."""

from .base import Family

FAMILY = Family(
    name="granitemoehybrid",
    module="transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    block="GraniteMoeHybridMoE",
    config="GraniteMoeHybridConfig",
    model="GraniteMoeHybridForCausalLM",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=16,
              layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_state=8, mamba_d_head=16,
              mamba_chunk_size=8),
    router="router",
)

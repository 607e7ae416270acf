"""NLLB-MoE: top-2 router with expert capacity (tokens past it dropped) and a second-expert
policy; experts are a ModuleDict of non-gated ``fc2(act(fc1(x)))`` MLPs with token dropout;
refused."""

from .base import Family

FAMILY = Family(
    name="nllb_moe",
    module="transformers.models.nllb_moe.modeling_nllb_moe",
    block="NllbMoeSparseMLP",
    config="NllbMoeConfig",
    model="NllbMoeModel",
    tiny=dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
              encoder_attention_heads=2, decoder_attention_heads=2, num_experts=8, expert_capacity=8,
              encoder_sparse_step=1, decoder_sparse_step=1, decoder_start_token_id=2),
    router="router",
    refused="non-gated experts (a ModuleDict of fc1/fc2 MLPs) with expert capacity (overflowing tokens "
            "dropped) and token dropout",
)

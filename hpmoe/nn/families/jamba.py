"""Jamba: softmax top-k router, not renormalised, SwiGLU experts; MoE on the layers of
``expert_layer_period`` (the model's Mamba layers are outside the block)."""

from .base import Family

FAMILY = Family(
    name="jamba",
    module="transformers.models.jamba.modeling_jamba",
    block="JambaSparseMoeBlock",
    config="JambaConfig",
    model="JambaForCausalLM",
    tiny=dict(num_experts=8, num_experts_per_tok=2, expert_layer_period=1, expert_layer_offset=0,
              attn_layer_period=1, attn_layer_offset=0, use_mamba_kernels=False, mamba_d_state=4,
              mamba_dt_rank=4, mamba_expand=2),
    router="router",
)

"""DBRX: refused — its experts are flat w1/v1/w2 [E*F, H] tensors and its router module
returns logits only (the block itself picks the top-k and divides by their p-norm)."""

from .base import Family

FAMILY = Family(
    name="dbrx",
    module="transformers.models.dbrx.modeling_dbrx",
    block="DbrxFFN",
    config="DbrxConfig",
    model="DbrxForCausalLM",
    tiny=dict(d_model=32, n_heads=2, n_layers=2, max_seq_len=64,
              attn_config=dict(kv_n_heads=1, rope_theta=10000.0),
              ffn_config=dict(ffn_hidden_size=16, moe_num_experts=8, moe_top_k=2)),
    router="router",
    refused="flat w1/v1/w2 expert weights and routing outside the router module (top-k, p-norm)",
)

"""Inkling2: fp32 ``scoring_func`` router with score-correction bias, renormalised and scaled;
its experts compute a soft-capped SwiGLU, ``softcap(gate) * sigmoid(gate) * softcap(up)``;
refused."""

from .base import Family

FAMILY = Family(
    name="inkling2",
    module="transformers.models.inkling2.modeling_inkling2",
    block="Inkling2SparseMoeBlock",
    config="Inkling2TextConfig",
    model="Inkling2ForCausalLM",
    tiny=dict(n_routed_experts=8, num_experts_per_tok=2, swa_num_attention_heads=2, swa_num_key_value_heads=1,
              swa_head_dim=16, sliding_window_size=8, n_layers_per_attn_res_block=1),
    refused="soft-capped SwiGLU experts: tanh(gate / c1) * c1 * sigmoid(gate) * tanh(up / c2) * c2",
)

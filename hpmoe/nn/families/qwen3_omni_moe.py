"""Qwen3-Omni-MoE thinker text blocks: softmax top-k router (renormalised where
``norm_topk_prob``), SwiGLU experts."""

from .base import Family

FAMILY = Family(
    name="qwen3_omni_moe",
    module="transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe",
    block="Qwen3OmniMoeThinkerTextSparseMoeBlock",
    config="Qwen3OmniMoeTextConfig",
    model="Qwen3OmniMoeThinkerTextModel",
    tiny=dict(num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
)

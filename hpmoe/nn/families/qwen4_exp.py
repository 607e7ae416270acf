"""Qwen4-Exp text blocks: softmax top-k router (renormalised where ``norm_topk_prob``), SwiGLU
experts, a shared expert scaled by sigmoid(shared_expert_gate(x)).  Its hyper-connections,
per-layer embeddings, gated-delta-net and indexed attention are outside the block."""

from .base import GATED_DELTA_TINY, Family

FAMILY = Family(
    name="qwen4_exp",
    module="transformers.models.qwen4_exp.modeling_qwen4_exp",
    block="Qwen4ExpTextSparseMoeBlock",
    config="Qwen4ExpTextConfig",
    model="Qwen4ExpForCausalLM",
    tiny=dict(
        **GATED_DELTA_TINY,
        hc_count=2,
        hc_lowrank=4,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=2,
    ),
    shared="shared_expert",
    shared_gate="shared_expert_gate",
)

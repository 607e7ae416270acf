"""MiniMax(-Text-01): softmax top-k router, renormalised, training-time input jitter,
SwiGLU experts (the model's lightning attention is outside the block)."""

from .base import Family

FAMILY = Family(
    name="minimax",
    module="transformers.models.minimax.modeling_minimax",
    block="MiniMaxSparseMoeBlock",
    config="MiniMaxConfig",
    model="MiniMaxForCausalLM",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2, block_size=4),
    jitter="jitter_noise",
)

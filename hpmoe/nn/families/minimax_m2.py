"""MiniMax-M2: sigmoid router whose top-k choice adds the block's score-correction bias
(a buffer of the block, passed to the router), renormalised; SwiGLU experts."""

from .base import Family

FAMILY = Family(
    name="minimax_m2",
    module="transformers.models.minimax_m2.modeling_minimax_m2",
    block="MiniMaxM2SparseMoeBlock",
    config="MiniMaxM2Config",
    model="MiniMaxM2ForCausalLM",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2),
    jitter="jitter_noise",
    router_args=("e_score_correction_bias",),
)

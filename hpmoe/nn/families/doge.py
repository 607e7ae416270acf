"""Doge (``is_moe``): cross-domain MoE, a dense SwiGLU MLP plus product-key retrieval experts
of one neuron each, ``act(x . down_embed[e]) * w_e * up_embed[e]``; refused."""

from .base import Family

FAMILY = Family(
    name="doge",
    module="transformers.models.doge.modeling_doge",
    block="DogeCDMoE",
    config="DogeConfig",
    model="DogeForCausalLM",
    tiny=dict(is_moe=True, num_experts=16, num_experts_per_tok=2, keep_window_size=8),
    refused="single-neuron retrieval experts (act(x . down_embed[e]) * up_embed[e], no gate) chosen by "
            "product keys over two half-logit sets",
)

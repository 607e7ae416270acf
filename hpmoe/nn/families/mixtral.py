"""Mixtral: softmax top-k router, SwiGLU experts, training-time input jitter."""

from .base import Family

FAMILY = Family(
    name="mixtral",
    module="transformers.models.mixtral.modeling_mixtral",
    block="MixtralSparseMoeBlock",
    config="MixtralConfig",
    model="MixtralForCausalLM",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2),
    jitter="jitter_noise",
)

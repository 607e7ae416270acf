"""PhiMoE: sparsemixer routing (its router module), training-time input jitter."""

from .base import Family

FAMILY = Family(
    name="phimoe",
    module="transformers.models.phimoe.modeling_phimoe",
    block="PhimoeSparseMoeBlock",
    config="PhimoeConfig",
    model="PhimoeForCausalLM",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2),
    router="router",
    jitter="input_jitter_noise",
)

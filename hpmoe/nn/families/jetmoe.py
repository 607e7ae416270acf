"""JetMoE: refused — its experts are parallel input/output linears ([E, 2F, H] in,
[E, H, F] out) with one output bias shared by every expert, and its attention experts
(JetMoeMoA) are outside any MoE-FFN region."""

from .base import Family

FAMILY = Family(
    name="jetmoe",
    module="transformers.models.jetmoe.modeling_jetmoe",
    block="JetMoeMoE",
    config="JetMoeConfig",
    model="JetMoeForCausalLM",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2, kv_channels=16),
    router="router",
    refused="input_linear/output_linear experts with a shared output bias (and attention experts, JetMoeMoA)",
)

"""Solar-Open: DeepSeek-V3-style sigmoid router (score-correction bias for the choice,
group limits, renormalised, times ``routed_scaling_factor``), SwiGLU experts, shared experts."""

from .base import Family

FAMILY = Family(
    name="solar_open",
    module="transformers.models.solar_open.modeling_solar_open",
    block="SolarOpenMoE",
    config="SolarOpenConfig",
    model="SolarOpenForCausalLM",
    tiny=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        num_key_value_heads=2,
    ),
    shared="shared_experts",
)

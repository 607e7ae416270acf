"""Llama 4: refused — the router's sigmoid scores scale each expert's *input*
(``experts(x * score)``), not its output, which the region's combine does not compute."""

from .base import Family

FAMILY = Family(
    name="llama4",
    module="transformers.models.llama4.modeling_llama4",
    block="Llama4TextMoe",
    config="Llama4TextConfig",
    model="Llama4ForCausalLM",
    tiny=dict(
        num_local_experts=8, num_experts_per_tok=1, intermediate_size_mlp=32, interleave_moe_layer_step=1
    ),
    router="router",
    refused="routing scores scale the expert input (experts(x * sigmoid(score))), not the expert output",
)

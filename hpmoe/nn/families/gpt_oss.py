"""GPT-OSS: refused — its experts carry biases and a clamped SwiGLU (alpha, limit) over
interleaved gate/up columns stored transposed, which the region's kernels do not compute."""

from .base import Family

FAMILY = Family(
    name="gpt_oss",
    module="transformers.models.gpt_oss.modeling_gpt_oss",
    block="GptOssMLP",
    config="GptOssConfig",
    model="GptOssForCausalLM",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2),
    router="router",
    refused="expert biases and the clamped SwiGLU (swiglu_alpha, swiglu_limit, (up + 1) * glu) "
    "over interleaved gate/up columns",
)

"""HunYuan-MoE-V1: softmax top-k router (``gate.wg``), a shared MLP on every token."""

from .base import Family

FAMILY = Family(
    name="hunyuan_v1_moe",
    module="transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe",
    block="HunYuanMoEV1Moe",
    config="HunYuanMoEV1Config",
    model="HunYuanMoEV1ForCausalLM",
    tiny=dict(num_experts=8, moe_topk=2),
    shared="shared_mlp",
)

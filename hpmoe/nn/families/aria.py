"""Aria text blocks: top-k over logits, softmax over the k chosen; SwiGLU experts stored
transposed ([E, H, 2F], [E, F, H]), shared experts."""

from .base import ExpertsLayout, Family

FAMILY = Family(
    name="aria",
    module="transformers.models.aria.modeling_aria",
    block="AriaTextMoELayer",
    config="AriaTextConfig",
    model="AriaTextForCausalLM",
    tiny=dict(moe_num_experts=8, moe_topk=2, moe_num_shared_experts=1),
    router="router",
    shared="shared_experts",
    layout=ExpertsLayout.TRANSPOSED,
)

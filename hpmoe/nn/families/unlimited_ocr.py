"""Unlimited-OCR text blocks: DeepSeek-V2's softmax router (greedy or group-limited top-k,
times ``routed_scaling_factor``), SwiGLU experts, shared experts."""

from .base import Family

FAMILY = Family(
    name="unlimited_ocr",
    module="transformers.models.unlimited_ocr.modeling_unlimited_ocr",
    block="UnlimitedOcrTextMoe",
    config="UnlimitedOcrTextConfig",
    model="UnlimitedOcrTextModel",
    tiny=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        mlp_layer_types=["sparse"] * 2,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        num_key_value_heads=2,
    ),
    shared="shared_experts",
)

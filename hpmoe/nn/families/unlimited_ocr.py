"""Unlimited-OCR text blocks: DeepSeek-V2's softmax router (greedy or group-limited top-k,
times ``routed_scaling_factor``), SwiGLU experts, shared experts."""

from .base import GROUPED_TINY, Family

FAMILY = Family(
    name="unlimited_ocr",
    module="transformers.models.unlimited_ocr.modeling_unlimited_ocr",
    block="UnlimitedOcrTextMoe",
    config="UnlimitedOcrTextConfig",
    model="UnlimitedOcrTextModel",
    tiny=dict(
        **GROUPED_TINY,
        topk_method="group_limited_greedy",
        routed_scaling_factor=2.5,
        num_key_value_heads=2,
    ),
    shared="shared_experts",
)

"""DeepSeek-OCR 2 text blocks: DeepSeek-V2's softmax router (greedy or group-limited top-k,
times ``routed_scaling_factor``), SwiGLU experts, shared experts."""

from .base import GROUPED_TINY, Family

FAMILY = Family(
    name="deepseek_ocr2",
    module="transformers.models.deepseek_ocr2.modeling_deepseek_ocr2",
    block="DeepseekOcr2TextMoe",
    config="DeepseekOcr2TextConfig",
    model="DeepseekOcr2TextModel",
    tiny=dict(
        **GROUPED_TINY,
        topk_method="group_limited_greedy",
        routed_scaling_factor=2.5,
        num_key_value_heads=2,
    ),
    shared="shared_experts",
)

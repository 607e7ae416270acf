"""Hy4-VL text blocks: Hy4's block (DeepSeek-V3-style sigmoid router, experts with a
clamped SwiGLU, shared experts run beside the region)."""

from .base import Family
from .hy_v4 import FAMILY as HY_V4

FAMILY = Family(
    name="hy_v4_vl",
    module="transformers.models.hy_v4_vl.modeling_hy_v4_vl",
    block="HYV4VLMoE",
    config="HYV4VLTextConfig",
    model="HYV4VLTextModel",
    tiny=dict(HY_V4.tiny, qk_rope_head_dim=8, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                 mrope_section=[2, 1, 1])),
    shared="shared_experts",
    glu=HY_V4.glu,
)

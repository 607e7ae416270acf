"""GLM-5-Next text blocks: DeepSeek-V3-style sigmoid router (score-correction bias for the
choice, group limits, renormalised, times ``routed_scaling_factor``); experts and shared
experts with a clamped SwiGLU, ``silu(min(gate, limit)) * clamp(up, ±limit)`` (the shared
experts run beside the region).  Its hyper-connections, linear and indexed attention are
outside the block."""

from .base import GROUPED_TINY, Family
from .hy_v4 import clamped_glu

FAMILY = Family(
    name="glm5_next",
    module="transformers.models.glm5_next.modeling_glm5_next",
    block="Glm5NextTextMoE",
    config="Glm5NextTextConfig",
    model="Glm5NextTextModel",
    tiny=dict(
        **GROUPED_TINY,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_key_value_heads=2,
        index_topk=8,
        index_kpool=4,
        index_head_dim=8,
        index_n_heads=2,
        linear_head_dim=8,
        linear_num_heads=2,
        hc_mult=2,
        layer_types=["linear_attention", "indexed_attention"],
        swiglu_limit=0.1,  # low enough that the tiny model's pre-activations cross it
    ),
    shared="shared_experts",
    glu=clamped_glu,
)

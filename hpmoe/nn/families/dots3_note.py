"""dots3 (dots3_note) text blocks: DeepSeek-V3-style sigmoid router (score-correction bias
for the choice, group limits, renormalised, times ``routed_scaling_factor``), SwiGLU experts,
shared experts.  Its vision MoE (``Dots3NoteVisionMoE``) stays transformers' own."""

from .base import Family

FAMILY = Family(
    name="dots3_note",
    module="transformers.models.dots3_note.modeling_dots3_note",
    block="Dots3NoteTextMoE",
    config="Dots3NoteTextConfig",
    model="Dots3NoteForCausalLM",
    tiny=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        shared_experts_intermediate_size=16,
        mlp_layer_types=["sparse"] * 2,
        n_group=4,
        topk_group=2,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        num_key_value_heads=2,
        use_sliding_window=False,
        use_dsa=False,
    ),
    shared="shared_experts",
)

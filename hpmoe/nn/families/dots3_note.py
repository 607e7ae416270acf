"""dots3 (dots3_note) text blocks: DeepSeek-V3-style sigmoid router (score-correction bias
for the choice, group limits, renormalised, times ``routed_scaling_factor``), SwiGLU experts,
shared experts.  Its vision MoE (``Dots3NoteVisionMoE``) stays transformers' own."""

from .base import GROUPED_TINY, MLA_TINY, Family

FAMILY = Family(
    name="dots3_note",
    module="transformers.models.dots3_note.modeling_dots3_note",
    block="Dots3NoteTextMoE",
    config="Dots3NoteTextConfig",
    model="Dots3NoteForCausalLM",
    tiny=dict(
        **MLA_TINY,
        **GROUPED_TINY,
        shared_experts_intermediate_size=16,
        num_key_value_heads=2,
        use_sliding_window=False,
        use_dsa=False,
    ),
    shared="shared_experts",
)

"""A.X-K2: DeepSeek-V3-style sigmoid router (score-correction bias for the choice, group
limits, renormalised, times ``routed_scaling_factor``), SwiGLU experts, shared experts (its
sparse attention and gated norms are outside the block)."""

from .base import GROUPED_TINY, MLA_TINY, Family

FAMILY = Family(
    name="axk2",
    module="transformers.models.axk2.modeling_axk2",
    block="AXK2MoE",
    config="AXK2Config",
    model="AXK2ForCausalLM",
    tiny=dict(
        **MLA_TINY,
        **GROUPED_TINY,
        head_dim=8,
        num_key_value_heads=2,
        index_topk=8,
        index_head_dim=8,
        index_n_heads=2,
        gated_norm_rank=4,
    ),
    shared="shared_experts",
)

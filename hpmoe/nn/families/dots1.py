"""dots.llm1: DeepSeek-V3-style sigmoid router, shared experts."""

from .base import Family

FAMILY = Family(
    name="dots1",
    module="transformers.models.dots1.modeling_dots1",
    block="Dots1MoE",
    config="Dots1Config",
    model="Dots1ForCausalLM",
    tiny=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=0,
        n_group=4,
        topk_group=2,
    ),
    shared="shared_experts",
)

"""Kolibri-1: top-k over logits plus a score-correction bias, sigmoid of the chosen logits
(renormalised where ``norm_topk_prob``), SwiGLU experts and an ungated shared expert."""

from .base import Family

FAMILY = Family(
    name="kolibri1",
    module="transformers.models.kolibri1.modeling_kolibri1",
    block="Kolibri1SparseMoeBlock",
    config="Kolibri1Config",
    model="Kolibri1ForCausalLM",
    tiny=dict(num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=32, norm_topk_prob=True),
    shared="shared_experts",
)

"""Inkling2-Loop: Inkling2's MoE block (soft-capped SwiGLU experts); refused."""

from .base import Family
from .inkling2 import FAMILY as INKLING2

FAMILY = Family(
    name="inkling2_loop",
    module="transformers.models.inkling2_loop.modeling_inkling2_loop",
    block="Inkling2LoopSparseMoeBlock",
    config="Inkling2LoopTextConfig",
    model="Inkling2LoopForCausalLM",
    tiny=dict(INKLING2.tiny, loop_layer_index_start=1, loop_layer_index_end=2, loop_gate_rank=4),
    refused=INKLING2.refused,
)

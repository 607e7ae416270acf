"""MiniMax-M3 (VL) text blocks: sigmoid router whose top-k choice adds a score-correction bias,
renormalised; experts with GPT-OSS's clamped SwiGLU but gate and up halves not interleaved,
``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``, whose sum
the block multiplies by ``routed_scaling_factor`` (folded into the routing weights); a shared
MLP of the same gate (fused ``gate_up_proj``), run beside the region.  Its indexed attention
is outside the block."""

from torch import nn

from ...spec import GluForm
from .base import Family
from .laguna import routed_scale


def _glu(experts: nn.Module) -> GluForm:
    """``MiniMaxM3VLExperts._apply_gate`` with the experts' own alpha and limit."""
    return GluForm(alpha=float(experts.swiglu_alpha), limit=float(experts.swiglu_limit), up_shift=1.0)


FAMILY = Family(
    name="minimax_m3_vl",
    module="transformers.models.minimax_m3_vl.modeling_minimax_m3_vl",
    block="MiniMaxM3VLSparseMoeBlock",
    config="MiniMaxM3VLTextConfig",
    model="MiniMaxM3VLForCausalLM",
    tiny=dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        mlp_layer_types=["sparse"] * 2,
        shared_intermediate_size=16,
        dense_intermediate_size=32,
        index_n_heads=2,
        index_head_dim=8,
        index_block_size=4,
        index_topk_blocks=2,
        num_key_value_heads=2,
        swiglu_limit=0.1,
    ),
    shared="shared_experts",
    topk=routed_scale,
    block_attrs=("routed_scaling_factor",),
    glu=_glu,
)

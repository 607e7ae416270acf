"""Beam: DeepSeek-V3-style sigmoid router (score-correction bias for the choice, group limits,
renormalised); SwiGLU experts, the gate evaluated in fp32 (the region evaluates it in the
experts' dtype: the same in fp32, rounded once more in bf16), whose sum the block multiplies
by ``routed_scaling_factor`` (folded into the routing weights)."""

from torch import nn

from ...spec import PLAIN_GLU, GluForm
from .base import Family
from .laguna import routed_scale


def _glu(experts: nn.Module) -> GluForm:
    """``BeamExperts._apply_gate`` is ``act(gate) * up`` evaluated in fp32."""
    return PLAIN_GLU


FAMILY = Family(
    name="beam",
    module="transformers.models.beam.modeling_beam",
    block="BeamMoE",
    config="BeamConfig",
    model="BeamForCausalLM",
    tiny=dict(num_experts=8, num_experts_per_tok=2, mlp_layer_types=["sparse"] * 2, n_group=4, topk_group=2,
              routed_scaling_factor=2.0, num_key_value_heads=2),
    topk=routed_scale,
    block_attrs=("routed_scaling_factor",),
    glu=_glu,
)

"""Hy4: DeepSeek-V3-style sigmoid router (score-correction bias for the choice,
group limits, renormalised, times ``routed_scaling_factor``); experts with a clamped SwiGLU,
``silu(min(gate, limit)) * clamp(up, ±limit)``; shared experts (run beside the region).  Its
hyper-connections and indexed attention are outside the block."""

from torch import nn

from ...spec import GluForm
from .base import GROUPED_TINY, MLA_TINY, Family


def clamped_glu(experts: nn.Module) -> GluForm:
    """The experts' ``_apply_gate``: gate clamped above and up clamped to ``±swiglu_limit``."""
    return GluForm(limit=float(experts.swiglu_limit))


FAMILY = Family(
    name="hy_v4",
    module="transformers.models.hy_v4.modeling_hy_v4",
    block="HYV4MoE",
    config="HYV4Config",
    model="HYV4ForCausalLM",
    tiny=dict(
        **MLA_TINY,
        **GROUPED_TINY,
        num_key_value_heads=2,
        index_topk=8,
        index_head_dim=8,
        index_n_heads=2,
        hc_mult=2,
        swiglu_limit=0.1,  # low enough that the tiny model's pre-activations cross it
    ),
    shared="shared_experts",
    glu=clamped_glu,
)

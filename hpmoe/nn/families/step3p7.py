"""Step-3.7: sigmoid router whose top-k choice adds a score-correction bias, renormalised;
SwiGLU experts whose sum the block multiplies by ``moe_router_scaling_factor`` (folded into
the routing weights), and a shared MLP run beside the region.  A layer whose
``swiglu_limits`` entry clamps its experts *after* the activation,
``min(silu(gate), limit) * clamp(up, ±limit)`` (the released Step-3.7-Flash: layers 43-44),
is refused: the region clamps the gate before it."""

import math
from collections.abc import Callable

from torch import nn

from ...spec import PLAIN_GLU, GluForm
from .base import Family
from .laguna import routed_scale


def plain_unless_clamped(name: str) -> Callable[[nn.Module], GluForm]:
    """The reading of an ``_apply_gate`` that clamps after the activation where the layer
    has a limit: the plain gate where it has none (``limit`` None; inf before transformers
    5.25), else ``ValueError`` naming the family and the limit."""
    def glu(experts: nn.Module) -> GluForm:
        limit = getattr(experts, "limit", None)
        if limit is not None and not math.isinf(limit):
            raise ValueError(f"{name}: experts clamp after the activation, min(silu(gate), {limit}) * "
                             "clamp(up), which the region does not compute")
        return PLAIN_GLU
    return glu


FAMILY = Family(
    name="step3p7",
    module="transformers.models.step3p7.modeling_step3p7",
    block="Step3p7SparseMoeBlock",
    config="Step3p7TextConfig",
    model="Step3p7TextModel",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2, mlp_layer_types=["sparse"] * 2, share_expert_dim=16,
              moe_router_scaling_factor=2.0, num_key_value_heads=2, sliding_window=8),
    shared="shared_experts",
    topk=routed_scale,
    block_attrs=("routed_scaling_factor",),
    glu=plain_unless_clamped("step3p7"),
)

"""OpenAI privacy filter: linear router with a bias, softmax over the top-k logits divided by
k, the block multiplying the experts' sum by k again (folded into the routing weights);
experts stored transposed with biases and GPT-OSS's clamped SwiGLU with gate and up halves
not interleaved.  transformers computes these experts in fp32 whatever the weights' dtype;
the region computes them in the weights' (or autocast) dtype.  The block returns
``(hidden, router_scores)``."""

from typing import Any

import torch
from torch import nn

from ...spec import GluForm
from .base import ExpertsLayout, Family


def _topk(layer: nn.Module, routed: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's weights times the block's ``num_experts`` (its top-k)."""
    return routed[1] * layer.num_experts, routed[2]


def _glu(experts: nn.Module) -> GluForm:
    """``OpenAIPrivacyFilterExperts._apply_gate`` with the experts' own alpha and limit."""
    return GluForm(alpha=float(experts.alpha), limit=float(experts.limit), up_shift=1.0)


FAMILY = Family(
    name="openai_privacy_filter",
    module="transformers.models.openai_privacy_filter.modeling_openai_privacy_filter",
    block="OpenAIPrivacyFilterMLP",
    config="OpenAIPrivacyFilterConfig",
    model="OpenAIPrivacyFilterModel",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2, swiglu_limit=0.1),
    router="router",
    layout=ExpertsLayout.TRANSPOSED,
    topk=_topk,
    block_attrs=("num_experts",),
    returns=1,
    glu=_glu,
)

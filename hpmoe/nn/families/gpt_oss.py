"""GPT-OSS: linear router with a bias, softmax over the top-k logits; experts stored
transposed ([E, H, 2F], [E, F, H]) with biases, gate/up columns interleaved and a clamped
SwiGLU, ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``;
the block returns ``(hidden, router_scores)``."""

from torch import nn

from ...spec import GluForm
from .base import ExpertsLayout, Family


def _glu(experts: nn.Module) -> GluForm:
    """``GptOssExperts._apply_gate`` with the experts' own alpha and limit."""
    return GluForm(interleaved=True, alpha=float(experts.alpha), limit=float(experts.limit), up_shift=1.0)


FAMILY = Family(
    name="gpt_oss",
    module="transformers.models.gpt_oss.modeling_gpt_oss",
    block="GptOssMLP",
    config="GptOssConfig",
    model="GptOssForCausalLM",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2),
    router="router",
    layout=ExpertsLayout.TRANSPOSED,
    returns=1,
    glu=_glu,
)

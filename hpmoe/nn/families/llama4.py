"""Llama 4: sigmoid scores of the top-k logits scale each expert's *input*
(``experts(x * score)``), SwiGLU experts stored transposed ([E, H, 2F], [E, F, H]), a shared
expert beside them; the block returns ``(out, router_logits)``.  The region runs once per
slot on ``x * score`` with weight 1 (the released models route to one expert)."""

from typing import Any

import torch
from torch import nn

from .base import ExpertsLayout, Family, ScoreSide


def _topk(layer: nn.Module, routed: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The router returns (scores [N, E]: sigmoid of the top-k logits, 0 elsewhere, logits):
    its ids are the same ``topk`` of the logits, its weights those scores."""
    scores, logits = routed
    ids = torch.topk(logits, layer.router.top_k, dim=1).indices
    return scores.gather(1, ids), ids


FAMILY = Family(
    name="llama4",
    module="transformers.models.llama4.modeling_llama4",
    block="Llama4TextMoe",
    config="Llama4TextConfig",
    model="Llama4ForCausalLM",
    tiny=dict(
        num_local_experts=8, num_experts_per_tok=1, intermediate_size_mlp=32, interleave_moe_layer_step=1
    ),
    router="router",
    shared="shared_expert",
    layout=ExpertsLayout.TRANSPOSED,
    topk=_topk,
    score_side=ScoreSide.INPUT,
    returns=1,
)

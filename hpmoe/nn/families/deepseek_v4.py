"""DeepSeek-V4: a ``scoring_func`` router (sqrt-softplus) whose top-k choice adds a
score-correction bias, or on ``hash_moe`` layers a frozen token-id -> experts table
(``tid2eid[input_ids]``, the block's ``input_ids`` argument); renormalised and times
``routed_scaling_factor``.  Experts and shared experts compute a clamped SwiGLU,
``silu(min(gate, limit)) * clamp(up, ±limit)`` (the shared experts run beside the region).
Its hyper-connections and compressed attention are outside the block."""

from typing import Any

import torch
from torch import nn

from ...spec import GluForm
from .base import Family


def _route(layer: nn.Module, x: torch.Tensor, hidden_states: torch.Tensor,
           input_ids: torch.Tensor | None = None) -> Any:
    """The block's router call: a hash layer's router reads the token ids."""
    return layer.gate(hidden_states, input_ids) if layer.is_hash else layer.gate(hidden_states)


def _glu(experts: nn.Module) -> GluForm:
    """``DeepseekV4Experts._apply_gate``: gate clamped above, up to ``±limit``."""
    return GluForm(limit=float(experts.limit))


FAMILY = Family(
    name="deepseek_v4",
    module="transformers.models.deepseek_v4.modeling_deepseek_v4",
    block="DeepseekV4SparseMoeBlock",
    config="DeepseekV4Config",
    model="DeepseekV4ForCausalLM",
    tiny=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        mlp_layer_types=["hash_moe", "moe"],
        layer_types=["sliding_attention", "compressed_sparse_attention"],
        q_lora_rank=8,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=4,
        hc_mult=2,
        sliding_window=8,
        swiglu_limit=0.1,  # low enough that the tiny model's pre-activations cross it
    ),
    shared="shared_experts",
    glu=_glu,
    route=_route,
    block_attrs=("is_hash",),
)

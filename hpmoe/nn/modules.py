"""The parameter containers an ``hpmoe.MoE`` owns, named as transformers names them (so
state dicts are those of transformers): the router ``gate``, the routed ``experts`` and the
``shared_experts``."""

from __future__ import annotations

import torch
from torch import nn


class TopkRouter(nn.Module):
    """``gate``: weight [E, H] (float32 unless the model was cast) and, for sigmoid
    gates, the ``e_score_correction_bias`` [E] float32 buffer."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = _param(weight)
        if bias is not None:
            self.register_buffer("e_score_correction_bias", bias)


class FusedExperts(nn.Module):
    """``experts``: gate_up_proj [E, 2F, H] (gate rows [0, F), up rows [F, 2F), or
    alternating under ``MoESpec.glu.interleaved``) and down_proj [E, H, F], as transformers
    stores them; with biases also gate_up_proj_bias [E, 2F] and down_proj_bias [E, H]
    (``has_bias``, transformers' flag)."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, b13: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None):
        super().__init__()
        self.gate_up_proj = _param(gate_up_proj)
        self.down_proj = _param(down_proj)
        self.has_bias = b13 is not None
        if self.has_bias:
            self.gate_up_proj_bias, self.down_proj_bias = _param(b13), _param(b2)


class SharedMLP(nn.Module):
    """``shared_experts``: bias-free gate_proj, up_proj ([Fs, H]) and down_proj ([H, Fs])."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (_linear(w) for w in (gate, up, down))


def _param(t: torch.Tensor) -> nn.Parameter:
    """``t`` itself when it already is a Parameter (keeps a model's tensors), else a new one."""
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t)


def _linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = _param(weight)
    return lin

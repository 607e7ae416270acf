"""Interop with transformers: specs from configs, weights from MoE modules, tiny configs.

transformers is optional: it is imported inside the functions that need it.
Specs and ``ExpertWeights`` are read here for DeepSeek-V3 (``DeepseekV3Config`` /
``DeepseekV3MoE``) and Qwen3-MoE (``Qwen3MoeConfig`` / ``Qwen3MoeSparseMoeBlock``), for the
simulator and benchmarks; the drop-in layers of every family are ``hpmoe.nn.families``.

Numerics: the DeepSeek-V3 router computes its logits in fp32 as :func:`hpmoe.routing.route`
does.  The Qwen3-MoE router computes logits in the module dtype and casts the top-k weights
back to it, so for a bf16 Qwen3 module our (fp32) routing weights are more precise than
transformers' and near-ties may pick different experts; in fp32 both agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..spec import GateKind, MoESpec
from ..weights import ExpertWeights

# ---------------------------------------------------------------------------- configs


def _deepseek_v3_spec(config: Any, dtype: torch.dtype) -> MoESpec:
    return MoESpec(hidden=config.hidden_size, ffn=config.moe_intermediate_size,
                   experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                   shared_experts=config.n_shared_experts or 0, gate=GateKind.SIGMOID,
                   groups=config.n_group or 1, top_groups=config.topk_group or 1,
                   routed_scaling=float(config.routed_scaling_factor),
                   norm_topk=bool(config.norm_topk_prob), dtype=dtype)


def _qwen3_moe_spec(config: Any, dtype: torch.dtype) -> MoESpec:
    return MoESpec(hidden=config.hidden_size, ffn=config.moe_intermediate_size,
                   experts=config.num_experts, top_k=config.num_experts_per_tok,
                   gate=GateKind.SOFTMAX, norm_topk=bool(config.norm_topk_prob), dtype=dtype)


_SPEC_READERS: dict[str, Callable[[Any, torch.dtype], MoESpec]] = {
    "deepseek_v3": _deepseek_v3_spec,
    "qwen3_moe": _qwen3_moe_spec,
}


def spec_from_hf(config: Any, dtype: torch.dtype = torch.bfloat16) -> MoESpec:
    """The MoE layer shape of a ``DeepseekV3Config`` or ``Qwen3MoeConfig``.

    ``dtype`` (float32 or bfloat16) is the activation / expert-weight dtype of the spec.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in _SPEC_READERS:
        raise ValueError(f"config.model_type={model_type!r} is not one of {sorted(_SPEC_READERS)}")
    return _SPEC_READERS[model_type](config, dtype)


def tiny_deepseek_v3_config(**overrides: Any) -> Any:
    """A 1-layer DeepseekV3Config whose MoE layer is ``preset("tiny")`` (H 32, F 16, 8
    experts, top-2, 1 shared, 4 groups / top-2 groups, scaling 2.5).  No download."""
    from transformers import DeepseekV3Config

    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=1, first_k_dense_replace=0, num_attention_heads=2,
                  num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
                  qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  norm_topk_prob=True, max_position_embeddings=64, num_mtp_layers=0)
    return DeepseekV3Config(**{**fields, **overrides})


def tiny_qwen3_moe_config(**overrides: Any) -> Any:
    """A 1-layer Qwen3MoeConfig with an MoE layer of H 32, F 16, 8 experts, top-2,
    renormalised top-k weights.  No download."""
    from transformers import Qwen3MoeConfig

    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                  max_position_embeddings=64)
    return Qwen3MoeConfig(**{**fields, **overrides})


# ---------------------------------------------------------------------------- modules


def weights_from_hf(module: torch.nn.Module) -> ExpertWeights:
    """Parameters of a ``DeepseekV3MoE`` or ``Qwen3MoeSparseMoeBlock`` as ExpertWeights.

    The spec is read from the module itself; its dtype is that of the expert weights.
    router / router_bias become float32 copies; w13 / w2 are detached views of
    ``experts.gate_up_proj`` / ``experts.down_proj``; shared_w13 is
    ``cat(shared_experts.gate_proj.weight, shared_experts.up_proj.weight)``.
    """
    readers = _module_readers()
    for cls, reader in readers.items():
        if isinstance(module, cls):
            return reader(module)
    names = sorted(cls.__name__ for cls in readers)
    raise TypeError(f"module must be one of {names}, got {type(module).__name__}")


def _module_readers() -> dict[type, Callable[[Any], ExpertWeights]]:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return {DeepseekV3MoE: _deepseek_v3_weights, Qwen3MoeSparseMoeBlock: _qwen3_moe_weights}


def _deepseek_v3_weights(module: Any) -> ExpertWeights:
    gate, experts, shared = module.gate, module.experts, module.shared_experts
    ffn = experts.intermediate_dim
    if shared.intermediate_size % ffn:
        raise ValueError(f"shared_experts.intermediate_size={shared.intermediate_size} is not a "
                         f"multiple of experts.intermediate_dim={ffn}")
    spec = MoESpec(hidden=gate.hidden_dim, ffn=ffn, experts=gate.num_experts, top_k=gate.top_k,
                   shared_experts=shared.intermediate_size // ffn, gate=GateKind.SIGMOID,
                   groups=gate.num_group, top_groups=gate.topk_group,
                   routed_scaling=float(gate.routed_scaling_factor),
                   norm_topk=bool(gate.norm_topk_prob), dtype=experts.gate_up_proj.dtype)
    shared_w13 = torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).detach()
    return ExpertWeights(spec=spec, router=_f32(gate.weight), router_bias=_f32(gate.e_score_correction_bias),
                         w13=experts.gate_up_proj.detach(), w2=experts.down_proj.detach(),
                         shared_w13=shared_w13, shared_w2=shared.down_proj.weight.detach())


def _qwen3_moe_weights(module: Any) -> ExpertWeights:
    gate, experts = module.gate, module.experts
    spec = MoESpec(hidden=gate.hidden_dim, ffn=experts.intermediate_dim, experts=gate.num_experts,
                   top_k=gate.top_k, gate=GateKind.SOFTMAX, norm_topk=bool(gate.norm_topk_prob),
                   dtype=experts.gate_up_proj.dtype)
    bias = torch.zeros(gate.num_experts, device=gate.weight.device)
    return ExpertWeights(spec=spec, router=_f32(gate.weight), router_bias=bias,
                         w13=experts.gate_up_proj.detach(), w2=experts.down_proj.detach())


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32, copy=True)


def randomize_moe_(module: torch.nn.Module, seed: int = 0, bias_std: float = 0.1) -> torch.nn.Module:
    """Refill a transformers MoE block in place so its outputs are meaningful.

    transformers leaves the fused expert tensors as ``torch.empty``; here every parameter
    gets N(0, 1/fan_in) (fan_in = last dim) and ``e_score_correction_bias`` N(0, bias_std),
    drawn from ``torch.Generator().manual_seed(seed)``.  Returns the module.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g, device="cpu") / p.shape[-1] ** 0.5)
        for name, b in sorted(module.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g, device="cpu") * bias_std)
    return module

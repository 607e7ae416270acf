"""hf.py: specs read from transformers configs, and weights_from_hf + route + dense_moe
reproducing transformers' own MoE blocks."""

from __future__ import annotations

import types

import pytest
import torch

from hpmoe.nn.hf import (
    randomize_moe_,
    spec_from_hf,
    tiny_deepseek_v3_config,
    tiny_qwen3_moe_config,
    weights_from_hf,
)
from hpmoe.refs import dense_moe
from hpmoe.routing import route
from hpmoe.spec import GateKind, MoESpec, preset

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

# ---------------------------------------------------------------------------- specs


def test_default_configs_are_the_presets() -> None:
    assert spec_from_hf(transformers.DeepseekV3Config()) == preset("deepseek-v3")
    qwen = transformers.Qwen3MoeConfig(norm_topk_prob=True)  # as Qwen3-30B-A3B's config.json
    assert spec_from_hf(qwen) == preset("qwen3-30b-a3b")


def test_spec_reads_every_deepseek_field() -> None:
    config = tiny_deepseek_v3_config(hidden_size=48, moe_intermediate_size=24, n_routed_experts=12,
                                     num_experts_per_tok=3, n_shared_experts=2, n_group=3,
                                     topk_group=2, routed_scaling_factor=1.5, norm_topk_prob=False)
    assert spec_from_hf(config, torch.float32) == MoESpec(
        hidden=48, ffn=24, experts=12, top_k=3, shared_experts=2, gate=GateKind.SIGMOID, groups=3,
        top_groups=2, routed_scaling=1.5, norm_topk=False, dtype=torch.float32)


def test_spec_reads_every_qwen3_field() -> None:
    config = tiny_qwen3_moe_config(hidden_size=48, moe_intermediate_size=24, num_experts=12,
                                   num_experts_per_tok=3, norm_topk_prob=False)
    assert spec_from_hf(config, torch.float32) == MoESpec(
        hidden=48, ffn=24, experts=12, top_k=3, gate=GateKind.SOFTMAX, norm_topk=False,
        dtype=torch.float32)


def test_tiny_deepseek_config_is_the_tiny_preset() -> None:
    assert spec_from_hf(tiny_deepseek_v3_config(), torch.float32) == preset("tiny")


def test_unknown_config_and_module_are_rejected() -> None:
    with pytest.raises(ValueError, match="config.model_type='llama'"):
        spec_from_hf(types.SimpleNamespace(model_type="llama"))
    with pytest.raises(TypeError, match="got Linear"):
        weights_from_hf(torch.nn.Linear(4, 4))


@pytest.mark.parametrize("make", [tiny_deepseek_v3_config, tiny_qwen3_moe_config])
def test_weights_of_a_whole_model_layer(make) -> None:
    """The MoE block inside a full tiny model: spec as the config says, experts shared."""
    config = make()
    model = transformers.AutoModelForCausalLM.from_config(config)
    block = model.model.layers[0].mlp
    w = weights_from_hf(block)
    assert w.spec == spec_from_hf(config, torch.float32)
    assert w.w13.data_ptr() == block.experts.gate_up_proj.data_ptr()
    assert w.w2.data_ptr() == block.experts.down_proj.data_ptr()
    assert torch.equal(w.router, block.gate.weight)


# ---------------------------------------------------------------------------- outputs


def _deepseek(seed: int, **overrides) -> torch.nn.Module:
    return randomize_moe_(DeepseekV3MoE(tiny_deepseek_v3_config(**overrides)), seed=seed)


def _qwen3(seed: int, **overrides) -> torch.nn.Module:
    return randomize_moe_(Qwen3MoeSparseMoeBlock(tiny_qwen3_moe_config(**overrides)), seed=seed)


def _ours(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    w = weights_from_hf(block)
    flat = x.reshape(-1, x.shape[-1])
    return dense_moe(flat, w, route(flat, w)).view_as(x)


CASES = {
    "deepseek": lambda: _deepseek(1),
    "deepseek-wide": lambda: _deepseek(2, n_routed_experts=16, num_experts_per_tok=4,
                                       n_shared_experts=2, norm_topk_prob=False),
    "qwen3": lambda: _qwen3(3),
    "qwen3-unnormalised": lambda: _qwen3(4, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False),
}


@pytest.mark.parametrize("name", sorted(CASES))
@torch.no_grad()
def test_reproduces_transformers_fp32(name: str) -> None:
    block = CASES[name]()
    x = torch.randn(2, 7, block.experts.hidden_dim, generator=torch.Generator().manual_seed(5))
    expected = block(x)
    assert expected.abs().mean() > 0.1  # random init gives outputs worth comparing
    torch.testing.assert_close(_ours(block, x), expected, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_reproduces_deepseek_bf16() -> None:
    """transformers adds the weighted expert outputs in bf16 one expert at a time; we add in
    fp32 in slot order and round once, so the two differ by bf16 rounding only."""
    block = _deepseek(6).to(torch.bfloat16)
    w = weights_from_hf(block)
    assert w.spec.dtype == torch.bfloat16 and w.router.dtype == torch.float32
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(7)).bfloat16()
    torch.testing.assert_close(_ours(block, x), block(x), rtol=2e-2, atol=2e-2)

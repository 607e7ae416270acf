"""Dtypes of hpmoe layers in training setups: .to() after replacement, autocast, fp16,
and a bf16 default dtype (as ``from_pretrained(dtype=torch.bfloat16)`` sets)."""

import copy
import dataclasses

import pytest
import torch

from hpmoe import refs
from hpmoe.nn.conformance import CHECK_TILES, tiny_model
from hpmoe.nn.families import FAMILIES
from hpmoe.nn.layer import MoE
from hpmoe.nn.replace import replace_moe_blocks
from hpmoe.routing import route
from hpmoe.spec import preset
from hpmoe.weights import ExpertWeights

pytest.importorskip("transformers")
QWEN3 = next(f for f in FAMILIES if f.name == "qwen3_moe")
IDS = torch.arange(24).view(2, 12) % 61 + 2
BF16 = dict(atol=2e-2, rtol=2e-2)  # bf16 against fp32: the suite's bf16 tolerance (torch's rtol: 1.6e-2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def _pair():
    original = tiny_model(QWEN3)
    model = copy.deepcopy(original)
    replace_moe_blocks(model, virtual_ep=2, tiles=CHECK_TILES)
    return original, model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_layer_follows_its_parameters_after_to(dtype):
    original, model = _pair()
    original.to(dtype), model.to(dtype)
    want, got = original(input_ids=IDS).logits, model(input_ids=IDS).logits
    assert got.dtype == dtype
    assert _rel(got, want) < 2e-2


def test_autocast_runs_the_region_in_the_autocast_dtype():
    original, model = _pair()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = original(input_ids=IDS, labels=IDS), model(input_ids=IDS, labels=IDS)
    got.loss.backward()
    assert _rel(got.logits, want.logits) < 2e-2
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)  # fp32 master weights


def _fp32(w: ExpertWeights) -> ExpertWeights:
    """``w`` (a layer's, bf16) in fp32: the same values, exactly."""
    tensors = {f.name: getattr(w, f.name) for f in dataclasses.fields(w)}
    return dataclasses.replace(w, spec=w.spec.with_dtype(torch.float32), **{
        name: t.detach().float() for name, t in tensors.items() if isinstance(t, torch.Tensor)})


def test_a_bf16_default_dtype_builds_and_runs_layers():
    """Built under a bf16 default dtype, a layer and a replaced model compute in bf16 what
    the fp32 reference computes within bf16's tolerance: the layer's weights in fp32
    through the gate and refs.dense_moe, and the model before its replacement in fp32."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = MoE(preset("tiny", torch.bfloat16), virtual_ep=2, tiles=CHECK_TILES)
        x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
        out = layer(x)
        model = QWEN3.tiny_model()
        original = copy.deepcopy(model)
        replace_moe_blocks(model, tiles=CHECK_TILES)
        logits = model(input_ids=IDS).logits
    finally:
        torch.set_default_dtype(old)
    assert out.dtype == logits.dtype == torch.bfloat16
    w, x32 = _fp32(layer.expert_weights()), x.float()
    torch.testing.assert_close(out.float(), refs.dense_moe(x32, w, route(x32, w)), **BF16)
    torch.testing.assert_close(logits.float(), original.float()(input_ids=IDS).logits, **BF16)


def test_detached_weights_share_the_storage_and_record_no_gradient():
    from hpmoe.spec import preset
    from hpmoe.weights import ExpertWeights

    spec = preset("tiny")
    w = ExpertWeights.random(spec, 0)
    leaves = [t.requires_grad_() for t in (w.w13, w.w2, w.shared_w13, w.shared_w2)]
    parts = tuple(w.shared_w13.detach().chunk(2))
    d = ExpertWeights.routed(spec, *leaves, shared_parts=parts).detached()
    for mine, theirs in zip((d.w13, d.w2, d.shared_w13, d.shared_w2), leaves, strict=True):
        assert not mine.requires_grad and mine.data_ptr() == theirs.data_ptr()
    assert d.spec is spec and d.shared_parts is None and d.router.shape == (spec.experts, spec.hidden)

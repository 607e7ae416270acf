"""config._experts_implementation: "hpmoe" is one of transformers' experts implementations.

A replaced model runs the region under "hpmoe" and transformers' own experts under the
others (the switch is ``model.set_experts_implementation``); an unreplaced model set to
"hpmoe" runs the region through the custom op.  Every implementation gives transformers'
eager logits and gradients."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from hpmoe.engine import compiled
from hpmoe.nn.experts_impl import HPMOE, register
from hpmoe.nn.families import FAMILIES
from hpmoe.nn.layer import MoE
from hpmoe.nn.replace import replace_moe_blocks

transformers = pytest.importorskip("transformers")
from transformers.integrations import moe as hf_moe  # noqa: E402

FP32 = dict(atol=2e-5, rtol=2e-5)
FAMILY = {f.name: f for f in FAMILIES}


def _model(name: str) -> torch.nn.Module:
    return FAMILY[name].tiny_model(seed=0, num_hidden_layers=1).eval()


def _logits_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    ids = torch.arange(24).remainder(64).view(2, 12)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], **FP32)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, **FP32, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_replaced_model_follows_set_experts_implementation(name):
    original = _model(name)
    original.set_experts_implementation("eager")
    want = _logits_and_grads(original)
    model = copy.deepcopy(original)
    replace_moe_blocks(model)
    assert model.config._experts_implementation == HPMOE
    spies = {impl: mock.Mock(wraps=fn) for impl, fn in hf_moe.ALL_EXPERTS_FUNCTIONS._global_mapping.items()}
    with (mock.patch.dict(hf_moe.ALL_EXPERTS_FUNCTIONS._global_mapping, spies),
          mock.patch.object(MoE, "region", autospec=True, side_effect=MoE.region) as region):
        for impl in ("eager", "batched_mm", "grouped_mm", HPMOE):
            model.set_experts_implementation(impl)
            _assert_same(_logits_and_grads(model), want)
            assert region.called == (impl == HPMOE), impl
            for other, spy in spies.items():
                assert spy.called == (other == impl and impl != HPMOE), (impl, other)
                spy.reset_mock()
            region.reset_mock()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_unreplaced_model_set_to_hpmoe_runs_the_region(name):
    model = _model(name)
    model.set_experts_implementation("eager")
    want = _logits_and_grads(model)
    register()
    model.set_experts_implementation(HPMOE)
    with mock.patch("hpmoe.nn.experts_impl.run_region", wraps=compiled.run_region) as op:
        _assert_same(_logits_and_grads(model), want)
    assert op.called

"""Every family of hpmoe.nn.families against transformers: logits, aux loss and every
gradient of a tiny model with its MoE blocks replaced; refusals name the family."""

import pytest
import torch

from hpmoe.nn.conformance import check_family, tiny_model
from hpmoe.nn.families import FAMILIES, family_of
from hpmoe.nn.layer import MoE
from hpmoe.nn.replace import replace_moe_blocks

pytest.importorskip("transformers")
FAMILY = {f.name: f for f in FAMILIES}
ATOL = 2e-5  # fp32; measured <= 3.3e-6 (Qwen3-Next), <= 2e-7 elsewhere


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_family_equals_transformers_or_is_refused_by_name(family):
    row = check_family(family)
    if family.refused:
        assert row.refused.startswith(f"{family.name} ({family.block}) is not supported: ")
        return
    assert not row.refused and row.blocks == 2
    assert row.logits_err < ATOL and row.grad_err < ATOL
    assert row.aux_err is None or row.aux_err < 1e-6


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh"])
def test_gelu_experts_are_computed_not_replaced_by_silu(act):
    row = check_family(FAMILY["qwen3_moe"], hidden_act=act)
    assert row.logits_err < ATOL and row.grad_err < ATOL


def test_an_activation_without_kernel_is_refused_at_replacement():
    model = tiny_model(FAMILY["qwen3_moe"], hidden_act="relu2")
    with pytest.raises(ValueError, match="ReLUSquaredActivation is not supported"):
        replace_moe_blocks(model)


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3", "granitemoe"])
def test_replacement_keeps_parameter_objects_and_state_dict(name):
    model = tiny_model(FAMILY[name])
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    replace_moe_blocks(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].data_ptr() == ptr and torch.equal(after[k], v) for k, (ptr, v) in before.items())
    assert [id(p) for p in model.parameters()] == params
    assert sum(isinstance(m, MoE) for m in model.modules()) == 2


def test_refused_blocks_are_refused_before_anything_is_replaced():
    model = tiny_model(FAMILY["gpt_oss"])
    with pytest.raises(ValueError, match="gpt_oss .*clamped SwiGLU"):
        replace_moe_blocks(model)
    assert not any(isinstance(m, MoE) for m in model.modules())
    blocks = [m for m in model.modules() if family_of(m) is FAMILY["gpt_oss"]]
    with pytest.raises(ValueError, match="gpt_oss"):
        MoE.from_hf(blocks[0])

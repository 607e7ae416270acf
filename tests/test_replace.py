"""Drop-in replacement of transformers MoE blocks: MoE.from_hf, replace_moe_blocks and a
short run of examples/train_tiny.py (loss curves of the original and hpmoe models agree),
each pinned to a path that it asserts ran (``helpers.ran``)."""

import copy
import gc
import sys
from pathlib import Path

import pytest
import torch

from hpmoe.engine import ExactPath, RuntimePath
from hpmoe.nn.hf import randomize_moe_, tiny_deepseek_v3_config, tiny_qwen3_moe_config
from hpmoe.nn.layer import MoE
from hpmoe.nn.replace import replace_moe_blocks
from hpmoe.schedule import SchedulePolicy
from hpmoe.schedule.auto import Path as Run
from hpmoe.testing import spawn_gloo

from .helpers import TINY_TILES, pin, ran

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_tiny  # noqa: E402

FP32 = dict(atol=1e-5, rtol=1e-5)
LOSS_ATOL = 1e-5  # |loss difference| per step, fp32 (measured: <= 5e-7 over 300 steps)


def _block(family: str) -> torch.nn.Module:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if family == "deepseek_v3":
        return randomize_moe_(DeepseekV3MoE(tiny_deepseek_v3_config()), seed=1)
    return randomize_moe_(Qwen3MoeSparseMoeBlock(tiny_qwen3_moe_config()), seed=1)


def _step(module, x, dy):
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


# the taskflow of 1, 2 and 4 virtual ranks and kernel by kernel (which has no virtual ranks)
PATH_EPS = [(Run.TASKFLOW, 1), (Run.TASKFLOW, 2), (Run.TASKFLOW, 4), (Run.KERNEL_BY_KERNEL, 1)]


@pytest.mark.parametrize("path,virtual_ep", PATH_EPS, ids=[f"{p.value}-ep{ep}" for p, ep in PATH_EPS])
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_from_hf_forward_and_backward_equal_the_transformers_block(family, path, virtual_ep):
    block, pinned = _block(family), pin(path, virtual_ep)
    original = copy.deepcopy(block)
    layer = MoE.from_hf(block, **pinned.options)
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(2, 6, 32, generator=g), torch.randn(2, 6, 32, generator=g)
    want, got = _step(original, x, dy), _step(layer, x, dy)
    ran(layer, pinned.kind, tokens=12, **pinned.fields)
    torch.testing.assert_close(got[0], want[0], **FP32)
    torch.testing.assert_close(got[1], want[1], **FP32)
    assert list(got[2]) == list(want[2])
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, **FP32, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_from_hf_keeps_the_blocks_parameter_objects_and_state_dict(family):
    block = _block(family)
    layer = MoE.from_hf(block)
    assert [id(p) for p in layer.parameters()] == [id(p) for p in block.parameters()]
    assert list(layer.state_dict()) == list(block.state_dict())
    pairs = zip(layer.state_dict().values(), block.state_dict().values(), strict=True)
    assert all(a.data_ptr() == b.data_ptr() for a, b in pairs)  # same storage, no copies


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "deepseek_v3":
        return transformers.DeepseekV3ForCausalLM(tiny_deepseek_v3_config(num_hidden_layers=2))
    return transformers.Qwen3MoeForCausalLM(tiny_qwen3_moe_config(num_hidden_layers=2))


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_replace_moe_blocks_leaves_the_state_dict_unchanged(family):
    model = _model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    ids = torch.arange(24).view(2, 12) % 64
    logits = model(input_ids=ids).logits
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the swap
    replaced = replace_moe_blocks(model, virtual_ep=2, tiles=TINY_TILES, schedule=None)
    names = replaced.names
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"] and replaced.session is None
    assert all(isinstance(model.get_submodule(n), MoE) for n in names)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert [id(p) for p in model.parameters()] == params
    out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, logits, **FP32)
    assert len(ran(model, ExactPath, ep=2, tiles=TINY_TILES)) == 2
    out.loss.backward()
    opt.step()
    key = "model.layers.0.mlp.experts.down_proj"
    assert not torch.equal(model.get_parameter(key), before[key])  # the optimizer reaches it


def test_replace_moe_blocks_refuses_models_without_blocks_and_blocks_themselves():
    with pytest.raises(ValueError, match="holds no block of type"):
        replace_moe_blocks(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="use hpmoe.MoE.from_hf"):
        replace_moe_blocks(_block("qwen3_moe"))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        replace_moe_blocks("model")
    with pytest.raises(TypeError, match="module must be a transformers MoE block of"):
        MoE.from_hf(torch.nn.Linear(3, 3))


def test_virtual_ep_not_dividing_the_experts_is_refused_before_any_replacement():
    model = transformers.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(num_experts=3))
    block = model.model.layers[0].mlp
    with pytest.raises(ValueError, match="virtual_ep=2 does not divide the block's 3 experts"):
        replace_moe_blocks(model, virtual_ep=2)
    assert model.model.layers[0].mlp is block
    with pytest.raises(ValueError, match="virtual_ep=2 does not divide"):
        MoE.from_hf(block, virtual_ep=2)


# ---------------------------------------------------------------------------- example

SHORT = train_tiny.TrainConfig(steps=6, batch=4, seq=8, layers=1)


def test_example_loss_curves_agree_with_virtual_ranks():
    """The example's model and training loop (``run_virtual``'s steps) with its blocks
    pinned to the taskflow of 2 virtual ranks."""
    model = train_tiny.make_model(SHORT)
    replace_moe_blocks(model, virtual_ep=2, tiles=train_tiny.TILES, schedule=None)
    hp = train_tiny.train(model, train_tiny.synthetic_batches(SHORT), SHORT)
    ran(model, ExactPath, ep=2, tiles=train_tiny.TILES)
    original = train_tiny.run_original(SHORT)
    assert len(original) == len(hp) == SHORT.steps
    assert train_tiny.Curves(original, hp).max_abs_diff() <= LOSS_ATOL
    assert hp[-1] < hp[0]


def _example_rank(rank: int, world: int, cfg: train_tiny.TrainConfig) -> list[float]:
    """``train_tiny.run_rank``'s steps with the blocks pinned to the runtime taskflow under
    HYPERPARALLEL, asserted to have run it."""
    import torch.distributed as dist

    model = train_tiny.make_model(cfg)
    replaced = replace_moe_blocks(model, ep_group=dist.group.WORLD, tiles=train_tiny.TILES,
                                  schedule=SchedulePolicy.HYPERPARALLEL)
    share = train_tiny.synthetic_batches(cfg).chunk(world, dim=1)[rank]
    losses = train_tiny.train(model, share, cfg, group=dist.group.WORLD)
    ran(model, RuntimePath, policy=SchedulePolicy.HYPERPARALLEL, tiles=train_tiny.TILES)
    replaced.close()  # as run_rank: the session's threads and shared memory, then every holder of the group
    del model, replaced
    gc.collect()
    return losses


def test_example_loss_curves_agree_at_ep2_on_gloo_ranks():
    ranks = spawn_gloo(_example_rank, 2, SHORT, timeout=120)
    assert ranks[0] == ranks[1]  # the logged loss is the all-reduced mean
    assert train_tiny.Curves(train_tiny.run_original(SHORT), ranks[0]).max_abs_diff() <= LOSS_ATOL

"""A layer's calls without gradients reuse the region weights of the last one
(``nn.weights_cache``) only while none of its parameters has changed: each change a
user or a library makes is seen by the next call, which equals the dense reference on
the layer's current parameters."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hpmoe import MoE, refs
from hpmoe.routing import Routing, route
from hpmoe.spec import preset
from hpmoe.weights import ExpertWeights

SPEC = preset("tiny")


def _layer() -> MoE:
    return MoE(SPEC, ExpertWeights.random(SPEC, 0))


def _inputs() -> tuple[torch.Tensor, Routing]:
    x = torch.randn(24, SPEC.hidden, generator=torch.Generator().manual_seed(3))
    return x, route(x, ExpertWeights.random(SPEC, 1))


def _agrees(layer: MoE, x: torch.Tensor, routing: Routing) -> None:
    with torch.no_grad():
        got = layer.region(x, routing.ids, routing.weights)
    torch.testing.assert_close(got, refs.dense_moe(x, layer.expert_weights().detached(), routing))


def _in_place(layer: MoE) -> None:
    layer.shared_experts.up_proj.weight.mul_(-2.0)  # the fused gate/up is a copy
    layer.experts.down_proj.add_(0.5)


def _new_storage(layer: MoE) -> None:
    layer.experts.gate_up_proj.data = layer.experts.gate_up_proj.data * 3.0


def _replaced_parameter(layer: MoE) -> None:  # as FSDP registers its unsharded parameters
    old = layer.experts.down_proj
    layer.experts._parameters["down_proj"] = nn.Parameter(old.detach() * -1.0)


def _replaced_module(layer: MoE) -> None:
    old = layer.shared_experts.gate_proj
    new = nn.Linear(old.in_features, old.out_features, bias=False)
    new.weight.data = old.weight.detach() + 1.0
    layer.shared_experts.gate_proj = new


def _loaded_state(layer: MoE) -> None:
    state = {k: v * 0.5 for k, v in layer.state_dict().items()}
    layer.load_state_dict(state)


@pytest.mark.parametrize("change", [_in_place, _new_storage, _replaced_parameter, _replaced_module,
                                    _loaded_state], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("copied", [False, True], ids=["layer", "its-deep-copy"])
def test_a_call_after_a_parameter_change_computes_on_the_new_parameters(change, copied):
    """Also on a deep copy of a layer that has run (an EMA model): its parameters are
    other tensors in other modules, which its own calls watch."""
    layer, (x, routing) = _layer(), _inputs()
    _agrees(layer, x, routing)
    if copied:
        layer = copy.deepcopy(layer)
        _agrees(layer, x, routing)
    with torch.no_grad():
        before = layer.region(x, routing.ids, routing.weights)
        change(layer)
        after = layer.region(x, routing.ids, routing.weights)
    assert not torch.equal(before, after)
    _agrees(layer, x, routing)


def test_calls_without_a_change_reuse_one_build_and_a_cast_layer_builds_again():
    layer, (x, routing) = _layer(), _inputs()
    builds = []
    build = layer._region_weights
    layer._region_weights = lambda: builds.append(1) or build()
    with torch.no_grad():
        for _ in range(3):
            layer.region(x, routing.ids, routing.weights)
        assert len(builds) == 1
        layer.bfloat16()
        out = layer.region(x.bfloat16(), routing.ids, routing.weights)
    assert len(builds) == 2 and out.dtype == torch.bfloat16


def test_training_calls_reuse_the_parameters_and_follow_each_optimizer_step():
    """Calls with gradients on hpmoe's own layer (every tensor a parameter) build once;
    each step's gradients equal autograd's through the dense reference on the parameters
    the optimizer updated in place."""
    layer, (x, routing) = _layer(), _inputs()
    builds = []
    build = layer._region_weights
    layer._region_weights = lambda: builds.append(1) or build()
    params = [p for n, p in layer.named_parameters() if n != "gate.weight"]  # the routing is given
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    scale = torch.linspace(-1, 1, SPEC.hidden)
    for _ in range(3):
        opt.zero_grad()
        (layer.region(x, routing.ids, routing.weights) * scale).sum().backward()
        want = torch.autograd.grad((refs.dense_moe(x, build(), routing) * scale).sum(), params)
        for p, g in zip(params, want, strict=True):  # fp32 sums in other orders: ulps of the largest
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6 * float(g.abs().max()))
        opt.step()
    assert len(builds) == 1


def _one_family_per_layout() -> list:
    from hpmoe.nn.families import FAMILIES

    seen: dict = {}
    for f in FAMILIES:
        if not f.refused:
            seen.setdefault(f.layout, f)
    return list(seen.values())


@pytest.mark.parametrize("family", _one_family_per_layout(), ids=lambda f: f"{f.name}-{f.layout.name}")
def test_a_replaced_model_evaluated_again_after_an_update_in_place_matches_transformers(family):
    """Every expert layout (views of the block's tensors, or a copy its region reads): a
    model evaluated, its parameters then updated in place as an optimizer does, and
    evaluated again, equals transformers' model updated alike."""
    pytest.importorskip("transformers")
    import copy

    from hpmoe.nn.conformance import tiny_model
    from hpmoe.nn.replace import replace_moe_blocks

    model = tiny_model(family, 0)
    original = copy.deepcopy(model)
    replace_moe_blocks(model, backend="kernel_by_kernel")
    ids = torch.arange(24, device="cpu").view(2, 12) % 61 + 2
    with torch.no_grad():
        model(input_ids=ids)
        for m in (model, original):
            for name, p in m.named_parameters():
                p.mul_(1.01 + 0.01 * (len(name) % 7))
        got, want = model(input_ids=ids), original(input_ids=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=2e-5, atol=2e-5)


def test_a_replaced_models_evaluations_build_each_layers_weights_once():
    """A transformers model slices its layers' ModuleList each forward (a registration of
    modules into a new list): that is no change to a layer, whose weights stay kept."""
    pytest.importorskip("transformers")
    from hpmoe.nn.conformance import tiny_model
    from hpmoe.nn.families import FAMILIES
    from hpmoe.nn.replace import replace_moe_blocks

    model = tiny_model(next(f for f in FAMILIES if f.name == "qwen3_moe"), 0)
    replace_moe_blocks(model, backend="kernel_by_kernel")
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    builds = []
    for layer in layers:
        layer._region_weights = lambda build=layer._region_weights: builds.append(1) or build()
    with torch.no_grad():
        for _ in range(3):
            model(input_ids=torch.arange(24, device="cpu").view(2, 12) % 61 + 2)
    assert len(layers) == 2 and len(builds) == 2

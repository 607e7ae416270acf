"""torch.compile(fullgraph=True) over hpmoe layers: the region is a torch.library custom
op with fake implementations and a registered backward, so hpmoe causes no graph break."""

import copy
from dataclasses import replace

import pytest
import torch

from hpmoe.nn.conformance import CHECK_TILES
from hpmoe.nn.families import FAMILIES
from hpmoe.nn.layer import MoE
from hpmoe.spec import DispatchMode, preset

from .helpers import GPT_OSS_FORM


def _step(module, x):
    x = x.clone().requires_grad_()
    out = module(x)
    out.square().sum().backward()
    return out.detach(), x.grad


def _assert_compiled_equals_eager(layer, x):
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")  # raises on any graph break
    got, want = _step(compiled, x), _step(eager, x)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)
    for (name, p), q in zip(layer.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_native_layer_compiles_with_fullgraph():
    spec = preset("tiny")
    _assert_compiled_equals_eager(MoE(spec, virtual_ep=2, tiles=CHECK_TILES),
                                  torch.randn(2, 5, spec.hidden, generator=torch.Generator().manual_seed(0)))


def test_a_compiled_layer_compiles_once_for_calls_of_one_shape():
    """Nothing the layer updates per call (its load statistics) is a guard of the compiled
    graph: three calls, one compilation (transformers' static-cache tests count them)."""
    spec = preset("tiny")
    layer = MoE(spec, virtual_ep=2, tiles=CHECK_TILES)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    x = torch.randn(2, 5, spec.hidden, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        compiled(x)
    assert len(graphs) == 1


def test_a_layer_with_expert_biases_and_a_clamped_glu_compiles_with_fullgraph():
    spec = GPT_OSS_FORM
    _assert_compiled_equals_eager(MoE(spec, virtual_ep=2, tiles=CHECK_TILES),
                                  torch.randn(2, 5, spec.hidden, generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("dispatch", [DispatchMode.PER_RANK, DispatchMode.PER_NODE])
def test_a_deduplicated_layer_compiles_to_the_same_bits(dispatch):
    spec = preset("tiny")
    tiles = replace(CHECK_TILES, dispatch=dispatch, partial_dtype=torch.bfloat16)
    layer = MoE(spec, virtual_ep=4, nodes=2, tiles=tiles, schedule=None)
    eager = copy.deepcopy(layer)
    x = torch.randn(2, 6, spec.hidden, generator=torch.Generator().manual_seed(1))
    got, want = _step(torch.compile(layer, fullgraph=True, backend="aot_eager"), x), _step(eager, x)
    assert torch.equal(got[0], want[0])
    per_expert = _step(MoE(spec, virtual_ep=4, tiles=CHECK_TILES, schedule=None), x)
    assert not torch.equal(got[0], per_expert[0])  # the bf16 wire: the deduplicated region ran
    for (name, p), q in zip(layer.named_parameters(), eager.parameters(), strict=True):
        if name.startswith("experts"):  # untouched by the gate's own autograd
            assert torch.equal(p.grad, q.grad), name


def test_a_replaced_transformers_block_compiles_with_fullgraph():
    pytest.importorskip("transformers")
    fam = next(f for f in FAMILIES if f.name == "qwen3_moe")
    torch.manual_seed(0)
    block = fam.block_class()(fam.tiny_config())
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    _assert_compiled_equals_eager(MoE.from_hf(block, virtual_ep=2, tiles=CHECK_TILES),
                                  torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1)))

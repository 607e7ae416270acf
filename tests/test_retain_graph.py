"""Backward twice through one forward (``retain_graph=True``, as several losses or
``torch.autograd.grad`` then ``backward`` do): the second gives the first's gradients
again, on the paths whose saved state autograd keeps; the persistent kernel, whose
arena holds its state, says so by name; without ``retain_graph`` autograd's own error."""

from __future__ import annotations

import pytest
import torch

from hpmoe import MoE
from hpmoe.spec import preset
from hpmoe.weights import ExpertWeights

from .helpers import Path, pin, ran

SPEC = preset("tiny")


def _layer_and_input(path: Path) -> tuple[MoE, torch.Tensor, object]:
    p = pin(path, ep=2 if path is Path.TASKFLOW else 1)
    layer = MoE(SPEC, ExpertWeights.random(SPEC, 0), **p.options)
    x = torch.randn(16, SPEC.hidden, generator=torch.Generator().manual_seed(2)).requires_grad_()
    return layer, x, p


def _gradients(layer: MoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"x": x.grad, **{n: q.grad for n, q in layer.named_parameters() if q.grad is not None}}


@pytest.mark.parametrize("path", [Path.KERNEL_BY_KERNEL, Path.TASKFLOW], ids=lambda p: p.name)
def test_a_second_backward_with_the_graph_retained_gives_the_same_gradients(path):
    layer, x, p = _layer_and_input(path)
    loss = (layer(x) * torch.linspace(-1, 1, SPEC.hidden)).sum()
    loss.backward(retain_graph=True)
    ran(layer, p.kind, **p.fields)
    once = {n: g.clone() for n, g in _gradients(layer, x).items()}
    loss.backward()
    twice = _gradients(layer, x)
    assert once.keys() == twice.keys() and len(once) > 3
    for name, g in once.items():
        torch.testing.assert_close(twice[name], 2 * g, rtol=1e-6, atol=0, msg=name)


@pytest.mark.parametrize("path", [Path.KERNEL_BY_KERNEL, Path.PERSISTENT], ids=lambda p: p.name)
def test_a_second_backward_without_the_graph_raises_autograds_or_a_named_error(path):
    layer, x, _ = _layer_and_input(path)
    loss = layer(x).sum()
    loss.backward(retain_graph=path is Path.PERSISTENT)
    with pytest.raises(RuntimeError, match="backward through .*a second time"):
        loss.backward()

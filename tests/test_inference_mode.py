"""A layer evaluated under ``torch.inference_mode()`` and trained after it, on every path
and on an EP group: nothing the first calls leave behind (kept weights, scratch buffers,
programs, placeholders, the load, a session's buffers) is an inference tensor that a
later call writes or saves for its backward.  Each run starts from placeholders made in
inference mode (the process-wide caches cleared)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hpmoe import MoE, refs, weights
from hpmoe.routing import route
from hpmoe.spec import preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights

from .helpers import Path, pin, ran

SPEC = preset("tiny")


def _fresh_placeholders() -> None:
    weights._placeholder.cache_clear()
    weights._router_placeholders.cache_clear()


def _evaluate_then_train(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inference mode, no_grad, a training call's) outputs of ``layer`` on ``x``; the
    training call's backward runs."""
    with torch.inference_mode():
        first = layer(x)
    with torch.no_grad():
        second = layer(x)
    xg = x.clone().requires_grad_()
    third = layer(xg)
    third.sum().backward()
    assert xg.grad is not None and layer.experts.down_proj.grad is not None
    return first, second, third.detach()


PATHS = [Path.KERNEL_BY_KERNEL, Path.TASKFLOW, Path.PERSISTENT]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_a_layer_evaluated_in_inference_mode_then_trained_gives_the_reference(path):
    _fresh_placeholders()
    p = pin(path)
    w = ExpertWeights.random(SPEC, 0)
    layer = MoE(SPEC, w, **p.options)
    x = torch.randn(24, SPEC.hidden, generator=torch.Generator().manual_seed(3))
    got = _evaluate_then_train(layer, x)
    ran(layer, p.kind, **p.fields)
    want = refs.dense_moe(x, w, route(x, w))
    for out in got:
        torch.testing.assert_close(out, want)


def _rank_step(rank: int, world: int, backend: str) -> tuple[torch.Tensor, ...]:
    _fresh_placeholders()
    layer = MoE(SPEC, ExpertWeights.random(SPEC, 0), ep_group=dist.group.WORLD, backend=backend)
    x = torch.randn(8, SPEC.hidden, generator=torch.Generator().manual_seed(rank))
    try:
        return _evaluate_then_train(layer, x)
    finally:
        layer.close()


@pytest.mark.parametrize("backend", ["kernel_by_kernel", "exact"])
def test_an_ep_group_evaluated_in_inference_mode_then_trained_agrees_with_itself(backend):
    for first, second, third in spawn_gloo(_rank_step, 2, backend, timeout=120):
        torch.testing.assert_close(first, third)
        torch.testing.assert_close(second, third)

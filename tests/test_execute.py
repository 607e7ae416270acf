"""moe_forward (the tile task graph, run exactly) against the references."""

import functools

import numpy as np
import pytest
import torch

import hpmoe
from hpmoe import refs
from hpmoe.exec.exact import execute_forward
from hpmoe.nn.hf import weights_from_hf
from hpmoe.routing import Routing, RoutingKind, synthetic_routing
from hpmoe.schedule import SchedulePolicy
from hpmoe.spec import ParallelSpec, preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights

from .helpers import TINY_TILES

_taskflow = functools.partial(hpmoe.moe_forward, policy=SchedulePolicy.SERIAL)  # the task graph, not AUTO
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _inputs(dtype, ep, tokens, kind, seed=0):
    spec = preset("tiny", dtype)
    w = ExpertWeights.random(spec, seed)
    x = (torch.randn(ep * tokens, spec.hidden, generator=torch.Generator().manual_seed(seed + 1))).to(dtype)
    return x, w, synthetic_routing(kind, spec, ParallelSpec(ep, tokens), seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ep", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", list(RoutingKind))
def test_matches_dense_reference(dtype, ep, kind):
    if kind is RoutingKind.EMPTY_RANK and ep == 1:
        pytest.skip("one rank cannot be left empty")
    x, w, r = _inputs(dtype, ep, 5, kind)
    y = _taskflow(x, w, r, ep=ep, tiles=TINY_TILES)
    torch.testing.assert_close(y, refs.dense_moe(x, w, r), **TOL[dtype])


def test_single_token_and_one_token_per_rank():
    for ep, n in [(1, 1), (2, 2)]:
        x, w, _ = _inputs(torch.float32, ep, n // ep, RoutingKind.BALANCED)
        r = hpmoe.route(x, w)
        torch.testing.assert_close(_taskflow(x, w, r, ep=ep, tiles=TINY_TILES),
                                   refs.dense_moe(x, w, r), **TOL[torch.float32])


def test_default_tiles_with_the_gate():
    spec = preset("small", torch.float32)
    w = ExpertWeights.random(spec, 3)
    x = torch.randn(64, spec.hidden, generator=torch.Generator().manual_seed(4))
    r = hpmoe.route(x, w)
    torch.testing.assert_close(_taskflow(x, w, r, ep=4), refs.dense_moe(x, w, r),
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_identical_across_random_valid_orders(dtype):
    x, w, r = _inputs(dtype, 4, 7, RoutingKind.ZIPF, seed=5)
    base = _taskflow(x, w, r, ep=4, tiles=TINY_TILES)
    for seed in range(20):
        assert torch.equal(hpmoe.moe_forward(x, w, r, ep=4, tiles=TINY_TILES, order=seed), base), seed


def test_an_invalid_order_is_refused():
    x, w, r = _inputs(torch.float32, 2, 4, RoutingKind.BALANCED)
    g = execute_forward(x, w, r, 2, TINY_TILES).graph
    with pytest.raises(hpmoe.GraphError, match="before its event"):
        hpmoe.moe_forward(x, w, r, ep=2, tiles=TINY_TILES, order=np.arange(g.num_tasks)[::-1].copy())


def _serial_rank(rank, world, x, w, r):
    tokens = x.shape[0] // world
    mine = slice(rank * tokens, (rank + 1) * tokens)
    res = refs.serialized_ep_forward(x[mine], w, Routing(r.ids[mine], r.weights[mine]))
    return res.out, res.dispatch_recv, res.combine_recv


@pytest.mark.parametrize("kind", [RoutingKind.ZIPF, RoutingKind.EMPTY_RANK])
def test_moved_rows_equal_the_serialized_baselines_bit_for_bit(kind):
    ep = 4
    x, w, r = _inputs(torch.bfloat16, ep, 6, kind, seed=2)
    ours = execute_forward(x, w, r, ep, TINY_TILES)
    theirs = spawn_gloo(_serial_rank, ep, x, w, r)
    plan_counts = hpmoe.plan_routing(r.ids, w.spec, ParallelSpec(ep, 6)).counts
    for d in range(ep):
        # ours: grouped by expert then source; theirs: by source then expert
        seg = plan_counts[:, d, :]  # [src, L]
        ours_segments = torch.split(ours.buffers[d].recv, seg.t().reshape(-1).tolist())
        by_src = [ours_segments[e * ep + s] for s in range(ep) for e in range(seg.shape[1])]
        assert torch.equal(torch.cat(by_src), theirs[d][1])
        assert torch.equal(ours.buffers[d].comb, theirs[d][2])
        torch.testing.assert_close(ours.buffers[d].out, theirs[d][0], **TOL[torch.bfloat16])


@pytest.mark.parametrize("make", ["deepseek_v3", "qwen3_moe"])
def test_matches_transformers_blocks(make):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from hpmoe.nn import hf

    config = getattr(hf, f"tiny_{make}_config")()
    block = (DeepseekV3MoE if make == "deepseek_v3" else Qwen3MoeSparseMoeBlock)(config).float()
    hf.randomize_moe_(block, seed=7)
    w = weights_from_hf(block)
    x = torch.randn(1, 8, config.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = block(x).view(8, -1)
        flat = x.view(8, -1)
        got = _taskflow(flat, w, hpmoe.route(flat, w), ep=2, tiles=TINY_TILES)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_bad_inputs_name_the_field():
    x, w, r = _inputs(torch.float32, 2, 4, RoutingKind.BALANCED)
    with pytest.raises(ValueError, match="x has shape"):
        hpmoe.moe_forward(x[:, :5], w, r, ep=2)
    with pytest.raises(TypeError, match="x has dtype"):
        hpmoe.moe_forward(x.double(), w, r, ep=2)
    with pytest.raises(ValueError, match="x has NaN at row"):
        hpmoe.moe_forward(x.index_fill(0, torch.tensor([1]), float("nan")), w, r, ep=2)
    with pytest.raises(ValueError, match="expert id 8"):
        hpmoe.moe_forward(x, w, Routing(r.ids.clamp(max=0) + 8, r.weights), ep=2)
    with pytest.raises(ValueError, match="ep=3"):
        hpmoe.moe_forward(x[:6], w, Routing(r.ids[:6], r.weights[:6]), ep=3)
    with pytest.raises(ValueError, match="routing.ids has shape"):
        hpmoe.moe_forward(x, w, Routing(r.ids[:, :1], r.weights), ep=2)


def test_auto_is_the_default_and_gives_the_reference_bits(monkeypatch, tmp_path):
    monkeypatch.setenv("HPMOE_PROFILE", str(tmp_path / "none.json"))  # no model: kernel by kernel
    x, w, r = _inputs(torch.bfloat16, 2, 6, RoutingKind.ZIPF)
    assert torch.equal(hpmoe.moe_forward(x, w, r, ep=2), refs.dense_moe(x, w, r))
    with pytest.raises(ValueError, match="AUTO or SERIAL"):
        hpmoe.moe_forward(x, w, r, policy=SchedulePolicy.HYPERPARALLEL)
    with pytest.raises(ValueError, match="ep=5 must be a positive int dividing the 12 tokens"):
        hpmoe.moe_forward(x, w, r, ep=5)

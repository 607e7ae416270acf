"""Rank-deduplicated dispatch and reduced combine (DispatchMode.PER_RANK) against
the reference that sums in the same order and wire dtype."""

import dataclasses
import functools
import json

import numpy as np
import pytest
import torch

import hpmoe
from hpmoe import refs
from hpmoe.cli import main
from hpmoe.exec.exact import execute_forward, run_graph
from hpmoe.exec.program import rank_subgraph
from hpmoe.ir.graph import TaskKind, task_columns
from hpmoe.ir.verify import verify_graph
from hpmoe.regions import RegionKind, region
from hpmoe.regions.dedup_kernels import FORWARD_DEDUP, DedupBuffers, DedupContext
from hpmoe.regions.dedup_layout import dedup_factor, make_dedup_layout
from hpmoe.routing import Routing, RoutingKind, plan_routing, synthetic_routing
from hpmoe.schedule import QUEUE_POLICIES, SchedulePolicy
from hpmoe.sim.presets import hardware_preset
from hpmoe.spec import DispatchMode, ParallelSpec, TileSpec, preset
from hpmoe.weights import ExpertWeights

from .helpers import TINY_TILES, simulated_order

DEDUP = dataclasses.replace(TINY_TILES, dispatch=DispatchMode.PER_RANK)
_taskflow = functools.partial(hpmoe.moe_forward, policy=SchedulePolicy.SERIAL)  # the task graph, not AUTO
BF16_WIRE = dataclasses.replace(DEDUP, partial_dtype=torch.bfloat16)


def _inputs(dtype, ep, tokens, kind, seed=0):
    spec = preset("tiny", dtype)
    w = ExpertWeights.random(spec, seed)
    x = torch.randn(ep * tokens, spec.hidden, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return x, w, synthetic_routing(kind, spec, ParallelSpec(ep, tokens), seed)


@pytest.mark.parametrize("tiles", [DEDUP, BF16_WIRE], ids=["fp32-wire", "bf16-wire"])
@pytest.mark.parametrize("ep", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", [RoutingKind.ZIPF, RoutingKind.HOT, RoutingKind.EMPTY_RANK])
def test_bitwise_equal_to_the_rank_partials_reference(tiles, ep, kind):
    if kind is RoutingKind.EMPTY_RANK and ep == 1:
        pytest.skip("one rank cannot be left empty")
    x, w, r = _inputs(torch.bfloat16, ep, 5, kind)
    res = execute_forward(x, w, r, ep, tiles)
    verify_graph(res.graph)
    assert torch.equal(res.out, refs.dense_moe_rank_partials(x, w, r, ep, tiles.partial_dtype))
    torch.testing.assert_close(res.out, refs.dense_moe(x, w, r), atol=3e-2, rtol=3e-2)


def test_one_rank_with_fp32_partials_is_the_dense_reference():
    x, w, r = _inputs(torch.bfloat16, 1, 9, RoutingKind.ZIPF)
    assert torch.equal(_taskflow(x, w, r, ep=1, tiles=DEDUP), refs.dense_moe(x, w, r))


def test_fp32_layer_close_to_the_reference():
    x, w, r = _inputs(torch.float32, 4, 6, RoutingKind.ZIPF, seed=2)
    torch.testing.assert_close(_taskflow(x, w, r, ep=4, tiles=DEDUP),
                               refs.dense_moe_rank_partials(x, w, r, 4), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_identical_across_random_valid_orders(dtype):
    x, w, r = _inputs(dtype, 4, 7, RoutingKind.ZIPF, seed=5)
    base = _taskflow(x, w, r, ep=4, tiles=BF16_WIRE)
    for seed in range(12):
        assert torch.equal(hpmoe.moe_forward(x, w, r, ep=4, tiles=BF16_WIRE, order=seed), base), seed


@pytest.mark.parametrize("policy", QUEUE_POLICIES)
def test_every_policy_runs_in_its_simulated_order(policy):
    """Each policy's schedule is deadlock-free, and its simulated start order, run by
    the exact executor, gives the reference bits."""
    ep = 4
    x, w, r = _inputs(torch.bfloat16, ep, 6, RoutingKind.ZIPF, seed=3)
    plan = plan_routing(r.ids, w.spec, ParallelSpec(ep, 6))
    graph = FORWARD_DEDUP.lower(plan, DEDUP, None)
    sched, order = simulated_order(graph, policy, hardware_preset("ascend-a3"))
    d = make_dedup_layout(plan, DEDUP)
    xs = x.chunk(ep)
    buffers = [DedupBuffers.allocate(xs[i], d, DEDUP, i) for i in range(ep)]
    run_graph(sched.graph, FORWARD_DEDUP, buffers, [DedupContext.build(w, d, r, i) for i in range(ep)], order)
    out = torch.cat([b.out for b in buffers])
    assert torch.equal(out, refs.dense_moe_rank_partials(x, w, r, ep))


def _link_bytes(graph, kind):
    """[ep] bytes each rank's puts of ``kind`` send across ranks."""
    mine = graph.kind == kind
    return np.bincount(graph.rank[mine], weights=graph.link_bytes[mine], minlength=graph.ep)


def test_hand_made_routing_link_bytes():
    """tiny: 8 experts, top-2; at EP 4 rank r holds experts 2r, 2r+1."""
    spec = preset("tiny", torch.bfloat16)
    ids = torch.tensor([[2, 3],   # rank 0, token 0: both experts on rank 1 -> travels once
                        [0, 7],   # rank 0, token 1: rank 0 itself (no link) and rank 3
                        [0, 1],   # rank 1, token 0: both on rank 0 -> once
                        [3, 2],   # rank 1, token 1: its own rank -> never on the link
                        [4, 6], [5, 7], [6, 7], [1, 4]])
    r = Routing(ids=ids, weights=torch.full((8, 2), 0.5))
    plan = plan_routing(ids, spec, ParallelSpec(4, 2))
    row = spec.hidden * 2
    for tiles, wire in [(DEDUP, 4), (BF16_WIRE, 2)]:
        g = FORWARD_DEDUP.lower(plan, tiles, None)
        # rank 2: (4, 6) -> ranks 2, 3; (5, 7) -> 2, 3: two rows to rank 3.  rank 3: (6, 7) -> own;
        # (1, 4) -> ranks 0, 2.
        np.testing.assert_array_equal(_link_bytes(g, TaskKind.DISPATCH), np.array([2, 1, 2, 2]) * row)
        np.testing.assert_array_equal(_link_bytes(g, TaskKind.COMBINE),
                                      np.bincount([1, 3, 0, 3, 3, 0, 2], minlength=4) * spec.hidden * wire)
    per_expert = region(RegionKind.FORWARD).lower(plan, TINY_TILES, None)
    np.testing.assert_array_equal(_link_bytes(per_expert, TaskKind.DISPATCH), np.array([3, 2, 2, 2]) * row)
    assert dedup_factor(plan) == 9 / 7
    x = torch.randn(8, spec.hidden, generator=torch.Generator().manual_seed(0)).to(spec.dtype)
    w = ExpertWeights.random(spec, 0)
    out = _taskflow(x, w, r, ep=4, tiles=DEDUP)
    assert torch.equal(out, refs.dense_moe_rank_partials(x, w, r, 4))


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_link_bytes_are_the_distinct_remote_ranks_of_each_token(ep):
    spec = preset("small", torch.bfloat16)
    par = ParallelSpec(ep, 32)
    ids = synthetic_routing(RoutingKind.ZIPF, spec, par, 7).ids
    g = FORWARD_DEDUP.lower(plan_routing(ids, spec, par), TileSpec(dispatch=DispatchMode.PER_RANK), None)
    dst = ids // (spec.experts // ep)
    src = torch.arange(ep * 32)[:, None] // 32
    remote = [len({int(d) for d in row if int(d) != int(s)}) for row, s in zip(dst, src[:, 0], strict=True)]
    rows = np.bincount(src[:, 0].numpy(), weights=remote, minlength=ep)
    np.testing.assert_array_equal(_link_bytes(g, TaskKind.DISPATCH), rows * spec.hidden * 2)
    combine = g.link_bytes[g.kind == TaskKind.COMBINE].sum()
    np.testing.assert_array_equal(combine, rows.sum() * spec.hidden * 4)


def test_triton_backend_refuses_per_rank_dispatch():
    x, w, r = _inputs(torch.bfloat16, 2, 4, RoutingKind.ZIPF)
    with pytest.raises(ValueError, match="TileSpec.dispatch=.per-rank.: the triton backend"):
        hpmoe.moe_forward(x, w, r, ep=2, tiles=DEDUP, backend="triton")


def test_bad_partial_dtype_is_named():
    with pytest.raises(TypeError, match="TileSpec.partial_dtype"):
        TileSpec(partial_dtype=torch.float16)
    with pytest.raises(TypeError, match="TileSpec.dispatch"):
        TileSpec(dispatch="per-rank")



def test_cli_simulate_reports_link_bytes_per_rank_and_the_dedup_factor(capsys):
    args = ["simulate", "--preset", "tiny", "--ep", "4", "--tokens", "16", "--routing", "zipf", "--json",
            "--partial-dtype", "bf16"]
    out = {}
    for mode in DispatchMode:
        assert main([*args, "--dispatch", mode.value]) == 0
        out[mode] = json.loads(capsys.readouterr().out)
    spec, par = preset("tiny", torch.bfloat16), ParallelSpec(4, 16)
    plan = plan_routing(synthetic_routing(RoutingKind.ZIPF, spec, par, 0).ids, spec, par)
    tiles = TileSpec(dispatch=DispatchMode.PER_RANK, partial_dtype=torch.bfloat16)
    g = FORWARD_DEDUP.lower(plan, tiles, None)
    by_rank = _link_bytes(g, TaskKind.DISPATCH) + _link_bytes(g, TaskKind.COMBINE)
    assert out[DispatchMode.PER_RANK]["link_bytes"] == by_rank.astype(int).tolist()
    # bf16 partials: a deduplicated row costs what a per-expert row does, both ways.
    ratio = sum(out[DispatchMode.PER_EXPERT]["link_bytes"]) / sum(out[DispatchMode.PER_RANK]["link_bytes"])
    assert ratio > 1
    assert out[DispatchMode.PER_RANK]["dedup_factor"] == pytest.approx(ratio, abs=1e-4)


def test_one_rank_lowering_is_that_rank_of_the_full_graph():
    """What a rank lowers alone (as the runtime does) is its part of every rank's graph."""
    moe, par = preset("tiny"), ParallelSpec(4, 9)
    plan = plan_routing(synthetic_routing(RoutingKind.ZIPF, moe, par, 3).ids, moe, par)
    full = FORWARD_DEDUP.lower(plan, DEDUP, None)
    for r in range(4):
        (a, _), (b, _) = rank_subgraph(full, r), rank_subgraph(FORWARD_DEDUP.lower(plan, DEDUP, (r,)), r)
        for col in [*task_columns(), "threshold", "sig_ptr", "sig_rank", "sig_event"]:
            np.testing.assert_array_equal(getattr(a, col), getattr(b, col), err_msg=f"rank {r} {col}")


def test_each_dispatch_modes_region_family_is_one_constant_that_pickles_by_name():
    import pickle

    from hpmoe.regions.family import DEDUPLICATED, PER_EXPERT, region_family
    from hpmoe.spec import DispatchMode

    families = {m: region_family(dataclasses.replace(TINY_TILES, dispatch=m)) for m in DispatchMode}
    assert families[DispatchMode.PER_EXPERT] is PER_EXPERT
    assert families[DispatchMode.PER_RANK] is families[DispatchMode.PER_NODE] is DEDUPLICATED
    assert all(pickle.loads(pickle.dumps(f)) is f for f in (PER_EXPERT, DEDUPLICATED))

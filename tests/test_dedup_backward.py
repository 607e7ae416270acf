"""Backward of rank-deduplicated dispatch: dy travels once per (token, destination
rank), input gradients come back as one partial per (token, rank), router gradients are
computed on the expert's rank; checked against autograd and, bit for bit, against the
per-expert backward and the reference that sums in the same order."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from hpmoe import refs
from hpmoe.cli import main
from hpmoe.exec.exact import execute_forward, run_graph
from hpmoe.exec.exact_backward import Gradients, moe_forward_backward
from hpmoe.ir.graph import TaskKind
from hpmoe.ir.verify import verify_graph
from hpmoe.regions.backward_kernels import SavedActivations
from hpmoe.regions.base import Kept
from hpmoe.regions.dedup_backward import lower_dedup_backward
from hpmoe.regions.dedup_backward_kernels import (
    BACKWARD_DEDUP,
    DedupBackwardBuffers,
    DedupBackwardContext,
)
from hpmoe.regions.dedup_layout import make_dedup_layout
from hpmoe.routing import RoutingKind, plan_routing, synthetic_routing
from hpmoe.schedule import QUEUE_POLICIES
from hpmoe.sim.presets import hardware_preset
from hpmoe.spec import DispatchMode, GateKind, MoESpec, ParallelSpec, TileSpec, preset
from hpmoe.weights import ExpertWeights

from .helpers import GPT_OSS_FORM, TINY_TILES, simulated_order
from .test_backward import TOL, _reference
from .test_dedup_hierarchical import _analytical_rows, _tier_bytes

DEDUP = dataclasses.replace(TINY_TILES, dispatch=DispatchMode.PER_RANK)
BF16_WIRE = dataclasses.replace(DEDUP, partial_dtype=torch.bfloat16)
NODE = dataclasses.replace(TINY_TILES, dispatch=DispatchMode.PER_NODE)
NODE_BF16 = dataclasses.replace(NODE, partial_dtype=torch.bfloat16)
TOP4 = MoESpec(hidden=32, ffn=16, experts=16, top_k=4, shared_experts=1, gate=GateKind.SIGMOID,
               groups=4, top_groups=2, routed_scaling=2.5)
NO_SHARED = MoESpec(hidden=24, ffn=12, experts=8, top_k=3, gate=GateKind.SOFTMAX)
SPECS = {"tiny": preset("tiny"), "top4": TOP4, "no-shared": NO_SHARED, "gpt-oss-form": GPT_OSS_FORM}
FIELDS = [f.name for f in dataclasses.fields(Gradients)]


def _inputs(spec, dtype, ep, tokens, kind, seed=0):
    spec = spec.with_dtype(dtype)
    w = ExpertWeights.random(spec, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(ep * tokens, spec.hidden, generator=g).to(dtype)
    dy = torch.randn(ep * tokens, spec.hidden, generator=g).to(dtype)
    return x, w, synthetic_routing(kind, spec, ParallelSpec(ep, tokens), seed), dy


def _dx_reference(x, w, r, dy, ep, partial_dtype, recompute=False, nodes=1):
    """dx of the deduplicated backward from the per-expert backward's per-slot input
    gradients: refs.rank_partials_sum with unit weights (its summation order; per node
    with ``nodes`` > 1, as the relays sum)."""
    n, k = r.ids.shape
    buffers = moe_forward_backward(x, w, r, dy, ep, TINY_TILES, recompute=recompute).backward.buffers
    plan = plan_routing(r.ids, w.spec, ParallelSpec(ep, n // ep))
    h = w.spec.hidden
    slots = torch.cat([b.gcomb[plan.pos[i], :h] for i, b in enumerate(buffers)]).view(n, k, -1)
    sdx = torch.cat([b.sdx for b in buffers]) if w.has_shared else None
    return refs.rank_partials_sum(slots, torch.ones(n, k), r.ids // (w.spec.experts // ep), ep, sdx,
                                  w.spec.dtype, partial_dtype, nodes)


@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [DEDUP, BF16_WIRE], ids=["fp32-wire", "bf16-wire"])
@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("recompute", list(Kept), ids=[k.value for k in Kept])
def test_gradients_match_autograd_and_the_per_expert_backward(spec, dtype, tiles, ep, recompute):
    x, w, r, dy = _inputs(SPECS[spec], dtype, ep, 5, RoutingKind.ZIPF)
    got = moe_forward_backward(x, w, r, dy, ep, tiles, recompute=recompute).backward
    verify_graph(got.graph)
    want = _reference(x, w, r, dy)
    for name in FIELDS:
        a, b = getattr(got.grads, name), getattr(want, name)
        if a is None:
            assert b is None
            continue
        tol = TOL[dtype] if tiles.partial_dtype == torch.float32 or name != "dx" else TOL[torch.bfloat16]
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{n}: {m}")
    per_expert = moe_forward_backward(x, w, r, dy, ep, TINY_TILES, recompute=recompute).backward
    for name in FIELDS[1:]:  # dweights and every weight gradient: the same bits
        a, b = getattr(got.grads, name), getattr(per_expert.grads, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert torch.equal(got.grads.dx, _dx_reference(x, w, r, dy, ep, tiles.partial_dtype, recompute))


@pytest.mark.parametrize("kind", [RoutingKind.HOT, RoutingKind.EMPTY_RANK, RoutingKind.GROUPED])
def test_skewed_routings(kind):
    x, w, r, dy = _inputs(TOP4, torch.bfloat16, 4, 6, kind, seed=2)
    got = moe_forward_backward(x, w, r, dy, 4, BF16_WIRE).backward.grads
    assert torch.equal(got.dx, _dx_reference(x, w, r, dy, 4, torch.bfloat16))
    assert torch.equal(got.dweights, moe_forward_backward(x, w, r, dy, 4, TINY_TILES).backward.grads.dweights)


def test_bitwise_identical_across_random_valid_orders():
    """Every order, with the rows kept or (odd seeds) travelling again, gives the same bits."""
    x, w, r, dy = _inputs(TOP4, torch.bfloat16, 4, 7, RoutingKind.ZIPF, seed=5)
    base = moe_forward_backward(x, w, r, dy, 4, BF16_WIRE).backward.grads
    for seed in range(6):
        got = moe_forward_backward(x, w, r, dy, 4, BF16_WIRE, forward_order=seed, backward_order=seed + 1,
                                   recompute=(Kept.ALL, Kept.INPUT)[seed % 2])
        for name in FIELDS:
            a, b = getattr(got.backward.grads, name), getattr(base, name)
            assert (a is None and b is None) or torch.equal(a, b), (name, seed)


def test_thresholds_equal_signal_counts_and_one_rank_is_its_part():
    moe, par = TOP4, ParallelSpec(4, 9)
    plan = plan_routing(synthetic_routing(RoutingKind.ZIPF, moe, par, 1).ids, moe, par)
    g = lower_dedup_backward(plan, DEDUP, recompute=True)
    verify_graph(g)
    assert np.bincount(g.signals_global(), minlength=g.num_events).tolist() == g.threshold.tolist()
    for rank in range(4):
        part = lower_dedup_backward(plan, DEDUP, (rank,), recompute=True)
        mine = g.rank == rank
        for col in ("kind", "row0", "row1", "col0", "col1", "peer", "wait", "link_bytes"):
            np.testing.assert_array_equal(getattr(part, col), getattr(g, col)[mine], err_msg=col)


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_gradient_link_bytes_are_the_distinct_remote_ranks_of_each_token(ep):
    spec = preset("small", torch.bfloat16)
    par = ParallelSpec(ep, 32)
    ids = synthetic_routing(RoutingKind.ZIPF, spec, par, 7).ids
    tiles = TileSpec(dispatch=DispatchMode.PER_RANK, partial_dtype=torch.bfloat16)
    g = lower_dedup_backward(plan_routing(ids, spec, par), tiles)
    dst = ids // (spec.experts // ep)
    src = torch.arange(ep * 32) // 32
    rows = sum(len({int(d) for d in row if int(d) != int(s)}) for row, s in zip(dst, src, strict=True))

    def sent(kind):
        return g.link_bytes[g.kind == kind].sum()

    assert sent(TaskKind.GRAD_DISPATCH) == rows * spec.hidden * 2
    assert sent(TaskKind.GRAD_COMBINE) == rows * spec.hidden * 2
    assert sent(TaskKind.ROUTER_COMBINE) == rows * spec.top_k * 4


@pytest.mark.parametrize("tiles", [NODE, NODE_BF16], ids=["fp32-wire", "bf16-wire"])
@pytest.mark.parametrize(("ep", "nodes"), [(2, 2), (4, 2), (8, 2), (8, 4)])
@pytest.mark.parametrize("kind", [RoutingKind.ZIPF, RoutingKind.EMPTY_RANK, RoutingKind.GROUPED])
def test_relayed_gradients_are_the_reference_bits(tiles, ep, nodes, kind):
    """Through the relays: dx sums per node as the forward's output does; router and
    weight gradients are the per-expert backward's bits."""
    x, w, r, dy = _inputs(TOP4, torch.bfloat16, ep, 5, kind)
    got = moe_forward_backward(x, w, r, dy, ep, tiles, nodes=nodes).backward
    verify_graph(got.graph)
    assert (got.graph.kind == TaskKind.HOP_DISPATCH).any()
    assert torch.equal(got.grads.dx, _dx_reference(x, w, r, dy, ep, tiles.partial_dtype, nodes=nodes))
    per_expert = moe_forward_backward(x, w, r, dy, ep, TINY_TILES).backward.grads
    for name in FIELDS[1:]:
        a, b = getattr(got.grads, name), getattr(per_expert, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    torch.testing.assert_close(got.grads.dx, _reference(x, w, r, dy).dx, **TOL[torch.bfloat16])


def test_relayed_backward_is_bitwise_identical_across_orders():
    x, w, r, dy = _inputs(TOP4, torch.bfloat16, 8, 4, RoutingKind.GROUPED, seed=6)
    base = moe_forward_backward(x, w, r, dy, 8, NODE_BF16, nodes=2).backward.grads
    for seed in range(4):  # odd seeds: the input rows travel again, relayed beside the dy rows
        got = moe_forward_backward(x, w, r, dy, 8, NODE_BF16, backward_order=seed, nodes=2,
                                   recompute=(Kept.ALL, Kept.INPUT)[seed % 2]).backward.grads
        for name in FIELDS:
            a, b = getattr(got, name), getattr(base, name)
            assert (a is None and b is None) or torch.equal(a, b), (name, seed)


ORDER_CASES = {  # tiles, ep, tokens per rank, nodes, routing, hardware
    "per-rank": (DEDUP, 4, 6, 1, RoutingKind.ZIPF, "ascend-a3"),
    "per-node": (NODE, 8, 4, 2, RoutingKind.GROUPED, "h100"),
}


@pytest.mark.parametrize("policy", QUEUE_POLICIES)
@pytest.mark.parametrize("case", ORDER_CASES)
def test_every_policy_runs_in_its_simulated_order(case, policy):
    """Each policy's schedule of the per-rank and the relayed backward is deadlock-free,
    and its simulated start order, run by the exact executor, gives the default order's bits."""
    tiles, ep, tokens, nodes, kind, hw = ORDER_CASES[case]
    x, w, r, dy = _inputs(TOP4, torch.bfloat16, ep, tokens, kind, seed=3)
    step = moe_forward_backward(x, w, r, dy, ep, tiles, nodes=nodes)
    plan = plan_routing(r.ids, w.spec, ParallelSpec(ep, tokens, nodes))
    sched, order = simulated_order(BACKWARD_DEDUP.lower(plan, tiles, None), policy, hardware_preset(hw))
    d = make_dedup_layout(plan, tiles)
    fwd = execute_forward(x, w, r, ep, tiles, nodes=nodes).buffers
    saved = [SavedActivations.from_forward(b, False) for b in fwd]
    buffers = [DedupBackwardBuffers.allocate(saved[i], dy.chunk(ep)[i], d, tiles, i) for i in range(ep)]
    run_graph(sched.graph, BACKWARD_DEDUP, buffers,
              [DedupBackwardContext.build(w, d, r, i) for i in range(ep)], order)
    assert torch.equal(torch.cat([b.dx for b in buffers]), step.backward.grads.dx)
    assert torch.equal(torch.cat([b.dw for b in buffers]), step.backward.grads.dweights)


@pytest.mark.parametrize(("ep", "nodes"), [(4, 2), (8, 2), (16, 4)])
def test_relayed_gradient_bytes_per_tier_are_the_forward_count(ep, nodes):
    """dy retraces the forward's rows (the analytical count of the hierarchical test);
    input gradients come back the same way in the wire dtype, router gradients at k
    fp32 per row."""
    spec = preset("small", torch.bfloat16)
    par = ParallelSpec(ep, 32, nodes)
    ids = synthetic_routing(RoutingKind.GROUPED, spec, par, 7).ids
    tiles = TileSpec(dispatch=DispatchMode.PER_NODE, partial_dtype=torch.bfloat16)
    g = lower_dedup_backward(plan_routing(ids, spec, par), tiles)
    rows = _analytical_rows(ids, spec.experts // ep, ep, nodes, 32)
    out = _tier_bytes(g, (TaskKind.GRAD_DISPATCH, TaskKind.HOP_DISPATCH))
    np.testing.assert_array_equal(out, rows * spec.hidden * 2)
    # the input rows travelling again beside dy double the rows' bytes out, hop by hop
    again = lower_dedup_backward(plan_routing(ids, spec, par), tiles, recompute=Kept.INPUT)
    doubled = _tier_bytes(again, (TaskKind.GRAD_DISPATCH, TaskKind.HOP_DISPATCH))
    np.testing.assert_array_equal(doubled, 2 * out)
    back = _tier_bytes(g, (TaskKind.GRAD_COMBINE, TaskKind.HOP_COMBINE)).sum(axis=1)
    np.testing.assert_array_equal(back, rows.sum(axis=1) * spec.hidden * 2)
    dw = _tier_bytes(g, (TaskKind.ROUTER_COMBINE, TaskKind.HOP_ROUTER_COMBINE)).sum(axis=1)
    np.testing.assert_array_equal(dw, rows.sum(axis=1) * spec.top_k * 4)


def test_cli_simulates_the_deduplicated_backward(capsys):
    args = ["simulate", "--preset", "tiny", "--ep", "4", "--tokens", "16", "--routing", "zipf", "--json",
            "--backward"]
    assert main([*args, "--dispatch", "per-rank", "--partial-dtype", "bf16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["direction"] == "backward" and out["makespan_us"] >= out["lower_bound_us"] > 0
    spec, par = preset("tiny", torch.bfloat16), ParallelSpec(4, 16)
    plan = plan_routing(synthetic_routing(RoutingKind.ZIPF, spec, par, 0).ids, spec, par)
    g = lower_dedup_backward(plan, TileSpec(dispatch=DispatchMode.PER_RANK, partial_dtype=torch.bfloat16))
    assert out["link_bytes"] == np.bincount(g.rank, weights=g.link_bytes, minlength=4).astype(int).tolist()


def test_the_former_dedup_saved_name_is_the_saved_activations_with_a_deprecation_warning():
    import hpmoe.regions.dedup_backward_kernels as kernels

    with pytest.warns(DeprecationWarning, match="SavedActivations"):
        assert kernels.DedupSaved is SavedActivations
    with pytest.raises(AttributeError, match="NoSuchName"):
        kernels.NoSuchName  # noqa: B018

"""Hierarchical dispatch and combine (DispatchMode.PER_NODE): a token crosses between
nodes once per (token, node) to a relay that forwards it within the node and sums the
node's partials; checked against the reference that sums in the same order."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from hpmoe import refs
from hpmoe.cli import main
from hpmoe.exec.exact import execute_forward, run_graph
from hpmoe.exec.program import rank_subgraph
from hpmoe.ir.graph import IS_PUT, TaskKind, task_columns
from hpmoe.ir.verify import verify_graph
from hpmoe.regions.dedup_kernels import FORWARD_DEDUP, DedupBuffers, DedupContext
from hpmoe.regions.dedup_layout import make_dedup_layout
from hpmoe.routing import Routing, RoutingKind, plan_routing, synthetic_routing
from hpmoe.schedule import QUEUE_POLICIES
from hpmoe.sim.cost import put_tier, tier_link_bytes
from hpmoe.sim.presets import hardware_preset
from hpmoe.spec import DispatchMode, GateKind, MoESpec, ParallelSpec, TileSpec, preset
from hpmoe.weights import ExpertWeights

from .helpers import TINY_TILES, simulated_order

NODE = dataclasses.replace(TINY_TILES, dispatch=DispatchMode.PER_NODE)
NODE_BF16 = dataclasses.replace(NODE, partial_dtype=torch.bfloat16)
# tiny's widths (bf16 GEMM rows then do not depend on the tiling), top-4 of 16 experts in
# 4 groups, so that a token often reaches several ranks of another node
TOP4 = MoESpec(hidden=32, ffn=16, experts=16, top_k=4, shared_experts=1, gate=GateKind.SIGMOID,
               groups=4, top_groups=2, routed_scaling=2.5)


def _inputs(ep, tokens, kind, seed=0, dtype=torch.bfloat16):
    spec = TOP4.with_dtype(dtype)
    w = ExpertWeights.random(spec, seed)
    x = torch.randn(ep * tokens, spec.hidden, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return x, w, synthetic_routing(kind, spec, ParallelSpec(ep, tokens), seed)


@pytest.mark.parametrize("tiles", [NODE, NODE_BF16], ids=["fp32-wire", "bf16-wire"])
@pytest.mark.parametrize(("ep", "nodes"), [(2, 2), (4, 2), (8, 2), (8, 4)])
@pytest.mark.parametrize("kind", [RoutingKind.ZIPF, RoutingKind.EMPTY_RANK, RoutingKind.GROUPED])
def test_bitwise_equal_to_the_node_partials_reference(tiles, ep, nodes, kind):
    x, w, r = _inputs(ep, 6, kind)
    res = execute_forward(x, w, r, ep, tiles, nodes=nodes)
    verify_graph(res.graph)
    assert (res.graph.kind == TaskKind.HOP_DISPATCH).any()
    assert torch.equal(res.out, refs.dense_moe_rank_partials(x, w, r, ep, tiles.partial_dtype, nodes))
    torch.testing.assert_close(res.out, refs.dense_moe(x, w, r), atol=5e-2, rtol=5e-2)


def test_the_node_sum_changes_the_bits_the_reference_follows():
    """With bf16 partials, summing a node's partials before the wire is a different
    rounding than sending each rank's: the reference must follow the relay's order."""
    x, w, r = _inputs(8, 16, RoutingKind.GROUPED, seed=4)
    out = execute_forward(x, w, r, 8, NODE_BF16, nodes=2).out
    flat = refs.dense_moe_rank_partials(x, w, r, 8, torch.bfloat16)
    assert not torch.equal(out, flat)
    assert torch.equal(out, refs.dense_moe_rank_partials(x, w, r, 8, torch.bfloat16, nodes=2))


def test_one_node_is_per_rank_dispatch():
    moe, par = TOP4, ParallelSpec(4, 9)
    plan = plan_routing(synthetic_routing(RoutingKind.ZIPF, moe, par, 1).ids, moe, par)
    a = FORWARD_DEDUP.lower(plan, dataclasses.replace(NODE, dispatch=DispatchMode.PER_RANK), None)
    b = FORWARD_DEDUP.lower(plan, NODE, None)
    for col in [*task_columns(), "threshold", "sig_ptr", "sig_rank", "sig_event"]:
        np.testing.assert_array_equal(getattr(a, col), getattr(b, col), err_msg=col)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_identical_across_random_valid_orders(dtype):
    x, w, r = _inputs(8, 7, RoutingKind.GROUPED, seed=5, dtype=dtype)
    base = execute_forward(x, w, r, 8, NODE_BF16, nodes=2).out
    for seed in range(8):
        assert torch.equal(execute_forward(x, w, r, 8, NODE_BF16, order=seed, nodes=2).out, base), seed


@pytest.mark.parametrize("policy", QUEUE_POLICIES)
def test_every_policy_runs_in_its_simulated_order(policy):
    """Each policy's schedule of the two-tier graph is deadlock-free, and its simulated
    start order, run by the exact executor, gives the reference bits."""
    ep, nodes, tokens = 8, 2, 6
    x, w, r = _inputs(ep, tokens, RoutingKind.GROUPED, seed=3)
    plan = plan_routing(r.ids, w.spec, ParallelSpec(ep, tokens, nodes))
    sched, order = simulated_order(FORWARD_DEDUP.lower(plan, NODE, None), policy, hardware_preset("h100"))
    d = make_dedup_layout(plan, NODE)
    xs = x.chunk(ep)
    buffers = [DedupBuffers.allocate(xs[i], d, NODE, i) for i in range(ep)]
    run_graph(sched.graph, FORWARD_DEDUP, buffers, [DedupContext.build(w, d, r, i) for i in range(ep)], order)
    out = torch.cat([b.out for b in buffers])
    assert torch.equal(out, refs.dense_moe_rank_partials(x, w, r, ep, nodes=nodes))


# ------------------------------------------------------------------ link bytes per tier

def _tier_bytes(graph, kinds):
    """[2, ep] bytes each rank's puts of ``kinds`` send within (0) and between (1) nodes."""
    return tier_link_bytes(graph, kinds)


def _analytical_rows(ids, local, ep, nodes, tokens):
    """[2, ep] rows each rank sends within and between nodes, counted from the ids:
    a token's row to each other rank of its node; one row to each other node it
    reaches, sent by its own rank; within that node, the relay (its only destination
    there, else the rank with the source's index) sends one row to each other
    destination rank there."""
    rpn = ep // nodes
    rows = np.zeros((2, ep), np.int64)
    for n, experts in enumerate(ids.tolist()):
        src = n // tokens
        dsts = {e // local for e in experts}
        for node in {d // rpn for d in dsts}:
            here = {d for d in dsts if d // rpn == node}
            if node == src // rpn:
                rows[0, src] += len(here - {src})
                continue
            relay = next(iter(here)) if len(here) == 1 else node * rpn + src % rpn
            rows[1, src] += 1
            rows[0, relay] += len(here - {relay})
    return rows


def test_hand_made_routing_link_bytes_per_tier():
    """tiny: 8 experts, top-2; EP 4 on 2 nodes: rank r holds experts 2r, 2r+1; node 0
    is ranks 0-1, node 1 ranks 2-3."""
    spec = preset("tiny", torch.bfloat16)
    ids = torch.tensor([[4, 6],   # rank 0, token 0: ranks 2, 3 -> one hop to relay 2, which forwards to 3
                        [5, 0],   # rank 0, token 1: rank 0 itself, and rank 2 alone -> one hop to 2
                        [6, 7],   # rank 1, token 0: rank 3 alone -> one hop to 3
                        [4, 7],   # rank 1, token 1: ranks 2, 3 -> one hop to relay 3, 3 forwards to 2
                        [0, 2],   # rank 2, token 0: ranks 0, 1 -> one hop to relay 0, 0 forwards to 1
                        [5, 6],   # rank 2, token 1: rank 2 itself and rank 3 -> one row within node 1
                        [1, 3],   # rank 3, token 0: ranks 0, 1 -> one hop to relay 1, 1 forwards to 0
                        [7, 6]])  # rank 3, token 1: its own rank -> never on a link
    r = Routing(ids=ids, weights=torch.full((8, 2), 0.5))
    plan = plan_routing(ids, spec, ParallelSpec(4, 2, nodes=2))
    row = spec.hidden * 2
    for tiles, wire in [(NODE, 4), (NODE_BF16, 2)]:
        g = FORWARD_DEDUP.lower(plan, tiles, None)
        sent = np.array([[1, 1, 2, 1], [2, 2, 1, 1]])  # [tier, rank] rows out
        np.testing.assert_array_equal(_tier_bytes(g, (TaskKind.DISPATCH, TaskKind.HOP_DISPATCH)), sent * row)
        back = np.array([[1, 1, 1, 2], [1, 1, 2, 2]])  # partials retrace the rows: relay, then across
        np.testing.assert_array_equal(_tier_bytes(g, (TaskKind.COMBINE, TaskKind.HOP_COMBINE)),
                                      back * spec.hidden * wire)
    flat = FORWARD_DEDUP.lower(plan, dataclasses.replace(NODE, dispatch=DispatchMode.PER_RANK), None)
    np.testing.assert_array_equal(_tier_bytes(flat, (TaskKind.DISPATCH,))[1], np.array([3, 3, 2, 2]) * row)
    x = torch.randn(8, spec.hidden, generator=torch.Generator().manual_seed(0)).to(spec.dtype)
    w = ExpertWeights.random(spec, 0)
    out = execute_forward(x, w, r, 4, NODE_BF16, nodes=2).out
    assert torch.equal(out, refs.dense_moe_rank_partials(x, w, r, 4, torch.bfloat16, nodes=2))


@pytest.mark.parametrize(("ep", "nodes"), [(4, 2), (8, 2), (8, 4), (16, 4)])
def test_link_bytes_per_tier_are_the_analytical_count(ep, nodes):
    spec = preset("small", torch.bfloat16)
    par = ParallelSpec(ep, 32, nodes)
    ids = synthetic_routing(RoutingKind.GROUPED, spec, par, 7).ids
    g = FORWARD_DEDUP.lower(plan_routing(ids, spec, par), TileSpec(dispatch=DispatchMode.PER_NODE), None)
    rows = _analytical_rows(ids, spec.experts // ep, ep, nodes, 32)
    np.testing.assert_array_equal(_tier_bytes(g, (TaskKind.DISPATCH, TaskKind.HOP_DISPATCH)),
                                  rows * spec.hidden * 2)
    # every partial row retraces its row's path: as many combine bytes (fp32) per tier
    back = _tier_bytes(g, (TaskKind.COMBINE, TaskKind.HOP_COMBINE)).sum(axis=1)
    np.testing.assert_array_equal(back, rows.sum(axis=1) * spec.hidden * 4)
    assert set(np.unique(g.kind[IS_PUT[g.kind] & (put_tier(g) == 1)])) == {TaskKind.HOP_DISPATCH,
                                                                            TaskKind.HOP_COMBINE}


def test_one_rank_lowering_is_that_rank_of_the_full_graph():
    moe, par = TOP4, ParallelSpec(8, 9, nodes=2)
    plan = plan_routing(synthetic_routing(RoutingKind.GROUPED, moe, par, 3).ids, moe, par)
    full = FORWARD_DEDUP.lower(plan, NODE, None)
    for r in range(8):
        (a, _), (b, _) = rank_subgraph(full, r), rank_subgraph(FORWARD_DEDUP.lower(plan, NODE, (r,)), r)
        for col in [*task_columns(), "threshold", "sig_ptr", "sig_rank", "sig_event"]:
            np.testing.assert_array_equal(getattr(a, col), getattr(b, col), err_msg=f"rank {r} {col}")


def test_cli_simulate_reports_link_bytes_per_tier(capsys):
    args = ["simulate", "--preset", "small", "--ep", "8", "--nodes", "2", "--tokens", "16", "--routing",
            "grouped", "--hardware", "h100", "--json", "--partial-dtype", "bf16"]
    out = {}
    for mode in (DispatchMode.PER_RANK, DispatchMode.PER_NODE):
        assert main([*args, "--dispatch", mode.value]) == 0
        out[mode] = json.loads(capsys.readouterr().out)
    spec, par = preset("small", torch.bfloat16), ParallelSpec(8, 16, nodes=2)
    plan = plan_routing(synthetic_routing(RoutingKind.GROUPED, spec, par, 0).ids, spec, par)
    tiles = TileSpec(dispatch=DispatchMode.PER_NODE, partial_dtype=torch.bfloat16)
    g = FORWARD_DEDUP.lower(plan, tiles, None)
    tiers = _tier_bytes(g, list(TaskKind)).astype(int)
    got = out[DispatchMode.PER_NODE]["link_bytes_per_tier"]
    assert got == {"intra": tiers[0].tolist(), "inter": tiers[1].tolist()}
    assert out[DispatchMode.PER_NODE]["link_bytes"] == tiers.sum(axis=0).tolist()
    assert sum(got["inter"]) < sum(out[DispatchMode.PER_RANK]["link_bytes_per_tier"]["inter"])


def test_the_regions_size_symmetric_memory_from_the_steps_tiles():
    """Under per-node dispatch the relayed rows and bf16 partials need room: the module's
    regions size them from the tiles they are given, as the layout-bound ones do, whose
    lowering gives the same graph."""
    from hpmoe.regions.dedup_backward_kernels import BACKWARD_DEDUP, dedup_backward_region
    from hpmoe.regions.dedup_kernels import dedup_region

    ep, nodes, tokens = 8, 2, 6
    x, w, r = _inputs(ep, tokens, RoutingKind.GROUPED, seed=3)
    plan = plan_routing(r.ids, w.spec, ParallelSpec(ep, tokens, nodes))
    tiles = dataclasses.replace(NODE, partial_dtype=torch.bfloat16)
    d = make_dedup_layout(plan, tiles)
    for rank in range(ep):
        fwd = FORWARD_DEDUP.symmetric_shapes(plan, tiles, rank)
        assert fwd == dedup_region(d).symmetric_shapes(plan, tiles, rank)
        assert fwd["hrecv"][0][0] == d.hops.per_dst[rank] and fwd["pcomb"][1] == torch.bfloat16
        back = BACKWARD_DEDUP.symmetric_shapes(plan, tiles, rank)
        assert back == dedup_backward_region(d).symmetric_shapes(plan, tiles, rank)
        assert back["ghrecv"] == fwd["hrecv"] and back["dwcomb"] == ((d.send_rows[rank], w.spec.top_k),
                                                                   torch.float32)
    assert d.hops.per_dst.sum() > 0
    pairs = ((dedup_region(d), FORWARD_DEDUP), (dedup_backward_region(d), BACKWARD_DEDUP))
    for bound, free in pairs:
        g, want = bound.lower(plan, tiles, None), free.lower(plan, tiles, None)  # the bound layout's graph
        for col in (*task_columns(), "sig_event", "threshold"):
            np.testing.assert_array_equal(getattr(g, col), getattr(want, col), err_msg=col)

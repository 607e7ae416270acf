"""Expert placement: the planner against hand-made loads, the token-to-replica rule, and
layers under a placement against the same layers without one (outputs, every
gradient, Adam steps with a rebalance in the middle, on virtual and real ranks)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hpmoe import refs
from hpmoe.engine.balance import FOLD, LOAD_DECAY
from hpmoe.migration import Moves
from hpmoe.nn.layer import MoE
from hpmoe.placement import Placement, plan_placement, rank_loads, replicate
from hpmoe.routing import route
from hpmoe.runtime.session import RuntimeConfig
from hpmoe.spec import DispatchMode, MoESpec, TileSpec, preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights

HOT = np.array([100.0, 1, 1, 1, 1, 1, 1, 1])


def test_the_identity_placement_is_every_expert_in_order():
    p = Placement.identity(8, 2)
    assert p.is_identity and p.slots_per_rank == 4 and list(p.slot_rank()) == [0] * 4 + [1] * 4
    ids = torch.tensor([[0, 5], [7, 1]])
    assert p.physical_ids(ids, torch.tensor([0, 1]), torch.arange(2)) is ids


def test_a_placement_must_hold_every_expert_once_at_least_and_divide_over_ranks():
    with pytest.raises(ValueError, match=r"missing \[3\]"):
        Placement((0, 1, 2, 2), 4, 2)
    with pytest.raises(ValueError, match="ranks must divide the slots"):
        Placement((0, 1, 2), 3, 2)
    with pytest.raises(ValueError, match="redundant=1"):
        plan_placement(HOT, 2, 1)
    with pytest.raises(ValueError, match="finite"):
        plan_placement(np.array([1.0, np.nan]), 2)


def test_the_planner_replicates_the_hot_expert_on_every_rank_and_balances_the_ranks():
    assert list(replicate(HOT, 10, most=2)) == [2, 2, 1, 1, 1, 1, 1, 1]
    p = plan_placement(HOT, 2, 2)
    assert sorted(p.phy2log) == sorted([*range(8), 0, 1]) and p.slots_per_rank == 5
    holders = p.slot_rank()[np.array(p.phy2log) == 0]
    assert sorted(holders) == [0, 1]  # one replica per rank, never two on one
    before, after = rank_loads(Placement.identity(8, 2), HOT), rank_loads(p, HOT)
    assert before.max() == 103 and after.max() == pytest.approx(53.5) and after.sum() == pytest.approx(107)


def test_slots_not_spread_as_replicas_are_spares_of_their_ranks_heaviest_expert():
    load = np.array([100.0, 50, 1, 1, 1, 1, 1, 1])
    full, one, none = (plan_placement(load, 2, 2, spread=r) for r in (2, 1, 0))
    assert full.spread == (0, 1) and one.spread == (0,) and none.spread == ()
    for p in (one, none):
        per = p.slots_per_rank
        for r in range(2):
            mine = list(p.phy2log[r * per:(r + 1) * per])
            spares = [e for j, e in enumerate(mine) if e in mine[:j]]
            assert all(load[e] == max(load[x] for x in mine) for e in spares)  # copies of the heaviest
    assert rank_loads(none, load).max() == 102  # the hot expert's rank: 100 and two others
    assert rank_loads(full, load).max() == 78 and rank_loads(one, load).max() == 102  # three halves of 50
    assert (one.used == [True, False, True, True, True, True, True, True, True, True]).all()  # slot 1 spare
    with pytest.raises(ValueError, match="spread=3 must be between 0 and redundant=2"):
        plan_placement(load, 2, 2, spread=3)
    with pytest.raises(ValueError, match="spread=0: 2 experts and replicas leave a rank of ranks=4"):
        plan_placement(np.ones(2), 4, 2, spread=0)  # four slots, one a rank: two ranks get nothing


def test_migration_alone_repacks_without_replicas():
    load = np.array([9.0, 8, 1, 1, 7, 6, 1, 1])  # the two heaviest pairs share a rank
    p = plan_placement(load, 2, 0)
    assert p.slots == 8 and rank_loads(p, load).max() < rank_loads(Placement.identity(8, 2), load).max()


def test_given_the_current_placement_the_planner_keeps_experts_where_they_are():
    """Renumbering the packed ranks changes no rank's load but what a move carries: a
    hot expert among 16 moves 2 rows, not 14."""
    load = np.ones(16)
    load[0] = 100.0
    now = Placement.identity(16, 2)
    blind, kept = plan_placement(load, 2), plan_placement(load, 2, current=now)
    assert sorted(rank_loads(blind, load)) == sorted(rank_loads(kept, load))
    assert Moves.between(now, blind).rows().sum() == 14 and Moves.between(now, kept).rows().sum() == 2
    moves = Moves.between(now, kept)
    stay = [(q, row, j) for r, rows in enumerate(moves.source) for j, (q, row) in enumerate(rows) if q == r]
    assert len(stay) == 14 and all(row == j for _, row, j in stay)  # and each keeps its slot: no copy
    spread = plan_placement(np.arange(16.0) ** 2, 4, 4, nodes=2, current=Placement.identity(16, 4, nodes=2))
    assert sorted(spread.phy2log) == sorted(plan_placement(np.arange(16.0) ** 2, 4, 4, nodes=2).phy2log)


def test_hierarchical_packing_keeps_a_node_replica_within_reach():
    load = np.arange(16, dtype=float)[::-1] ** 2
    p = plan_placement(load, 4, 4, nodes=2)
    node_of = p.slot_rank() // 2
    for e in range(16):
        where = node_of[np.array(p.phy2log) == e]
        assert len(where) == len(set(where)) or len(where) > 2  # replicas spread over the nodes first


def test_a_token_uses_its_own_rank_replica_else_spreads_by_its_index():
    p = Placement((0, 1, 2, 0, 3, 4), 5, 2)  # expert 0 on both ranks, the rest once
    ids = torch.tensor([[0, 3]] * 4)
    ranks = torch.tensor([0, 0, 1, 1])
    phys = p.physical_ids(ids, ranks, torch.arange(4))
    assert phys[:, 0].tolist() == [0, 0, 3, 3]  # the replica on the token's rank
    assert phys[:, 1].tolist() == [4, 4, 4, 4]  # the only replica of expert 3
    far = Placement((0, 1, 2, 0, 3, 4), 5, 2)  # expert 0 on both ranks: tokens elsewhere spread
    spread = far.physical_ids(torch.zeros(6, 1, dtype=torch.long), torch.zeros(6, dtype=torch.long),
                              torch.arange(6))
    assert spread.flatten().tolist() == [0] * 6  # rank 0's tokens stay on rank 0
    three = Placement((0, 1, 2, 3, 0, 4, 5, 0), 6, 4)  # expert 0 on ranks 0, 2 and 3
    spread = three.physical_ids(torch.zeros(6, 1, dtype=torch.long), torch.ones(6, dtype=torch.long),
                                torch.arange(6))
    assert spread.flatten().tolist() == [0, 4, 7, 0, 4, 7]  # rank 1 holds none: by token index
    spare = Placement((1, 2, 3, 0, 0, 4), 5, 2)  # expert 0 only on rank 1, twice: slot 4 a spare
    spread = spare.physical_ids(torch.zeros(6, 1, dtype=torch.long), torch.zeros(6, dtype=torch.long),
                                torch.arange(6))
    assert spread.flatten().tolist() == [3] * 6
    assert spare.spread == () and three.spread == (0,)


# ---------------------------------------------------------------------------- layers

SPEC = preset("tiny", torch.float32)
TOL = dict(rtol=1e-5, atol=1e-5)


def _hot_batch(tokens, seed=0):
    """Random tokens and output gradients."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, SPEC.hidden, generator=g), torch.randn(tokens, SPEC.hidden, generator=g)


def _hot_weights():
    """Every token picks expert 0 (its selection bias is large), as in ``--routing hot``."""
    w = ExpertWeights.random(SPEC, 1)
    bias = w.router_bias.clone()
    bias[0] = 5.0
    return ExpertWeights(SPEC, w.router, bias, w.w13, w.w2, w.shared_w13, w.shared_w2)


def _step(layer, x, dy):
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _reference(layer, x, dy):
    """``_step``'s (out, x.grad, {name: grad}) by autograd through the gate and
    refs.dense_moe on ``layer``'s parameters."""
    x = x.clone().requires_grad_()
    w = layer.expert_weights()
    out = refs.dense_moe(x, w, route(x, w))
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _close(a, b):
    torch.testing.assert_close(a[0], b[0], **TOL)
    torch.testing.assert_close(a[1], b[1], **TOL)
    for name in b[2]:
        torch.testing.assert_close(a[2][name], b[2][name], **TOL, msg=name)


ONE_PROCESS = {"taskflow": {"schedule": None},  # both read the slots in place, replicas on one rank
               "kernel by kernel": {"backend": "kernel_by_kernel"}}


@pytest.mark.parametrize("path", ONE_PROCESS)
def test_a_replicated_layer_computes_the_dense_reference_before_and_after_its_rebalance(path):
    x, dy = _hot_batch(64)
    placed = MoE(SPEC, _hot_weights(), virtual_ep=2, **ONE_PROCESS[path])
    want = _reference(MoE(SPEC, _hot_weights()), x, dy)
    _close(_step(placed, x, dy), want)  # its first call measures the load
    assert placed.expert_load()[0] == placed.expert_load().max() > 0
    placed.zero_grad()
    assert placed.rebalance(redundant=2) is not None
    assert list(placed.placement.replicas()).count(2) == 2 and placed.placement.replicas()[0] == 2
    _close(_step(placed, x, dy), want)


def _adam(layer, rebalance_at, steps=5):
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    for i in range(steps):
        if i == rebalance_at:
            layer.rebalance(redundant=2, min_gain=1.0)
        x, dy = _hot_batch(48, seed=i)
        opt.zero_grad()
        (layer(x) * dy).sum().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("path", ONE_PROCESS)
def test_five_adam_steps_with_a_rebalance_in_the_middle_equal_five_without(path):
    want = _adam(MoE(SPEC, _hot_weights(), virtual_ep=2, **ONE_PROCESS[path]), rebalance_at=None)
    moved = MoE(SPEC, _hot_weights(), virtual_ep=2, **ONE_PROCESS[path])
    got = _adam(moved, rebalance_at=2)
    assert moved.placement is not None
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, **TOL, msg=name)


@pytest.mark.parametrize("path", ONE_PROCESS)
def test_every_path_reads_the_slots_in_place(monkeypatch, path):
    """Kernel by kernel and the taskflow read each slot's logical expert where it is
    stored and write its gradient there: no gather of the weights, no slot-sized
    gradient (tests/test_slot_rows.py checks the bits and the storage read)."""
    layer = MoE(SPEC, _hot_weights(), virtual_ep=2, **ONE_PROCESS[path])
    x, dy = _hot_batch(64)
    _step(layer, x, dy)
    layer.rebalance(redundant=2)
    slots = layer.placement.slot_weights(layer.expert_weights())
    assert slots.w13 is layer.experts.gate_up_proj and slots.slot_rows == layer.placement.phy2log
    gathers = []
    real = ExpertWeights.gathered
    monkeypatch.setattr(ExpertWeights, "gathered", lambda w, *a: gathers.append(w.slot_rows) or real(w, *a))
    _step(layer, x, dy)
    assert gathers == []


def test_a_placement_for_another_layout_is_refused():
    layer = MoE(SPEC, virtual_ep=2)
    with pytest.raises(ValueError, match="on 4 ranks"):
        layer.placement = Placement.identity(SPEC.experts, 4)
    with pytest.raises(ValueError, match="rebalance_every must be an int >= 0"):
        MoE(SPEC, rebalance_every=-1)


PATHS = {"taskflow": {"schedule": None}, "kernel by kernel": {"backend": "kernel_by_kernel"},
         "per-rank taskflow": {"schedule": None, "tiles": TileSpec(dispatch=DispatchMode.PER_RANK)},
         "taskflow, weights checksummed": {"schedule": None, "runtime": RuntimeConfig(check_weights=True)}}


def _ranks_step(rank, world, rebalance, options):
    layer = MoE(SPEC, _hot_weights(), ep_group=dist.group.WORLD, **options)
    x, dy = _hot_batch(64)
    mine = slice(rank * 32, (rank + 1) * 32)
    _step(layer, x[mine], dy[mine])  # measures the load
    layer.zero_grad()
    placement = layer.rebalance(redundant=2) if rebalance else None
    result = _step(layer, x[mine], dy[mine])
    layer.close()
    return result, placement


@pytest.mark.parametrize("rebalance, path", [(False, "taskflow"), *((True, p) for p in PATHS)])
def test_ranks_under_a_shared_placement_equal_one_process(rebalance, path):
    """Each rank reads its own slots in place on every path (every slot is stored where
    the agreement checksums the weights): outputs and gradients still equal one
    process's on every distributed path."""
    results = spawn_gloo(_ranks_step, 2, rebalance, PATHS[path], timeout=120)
    x, dy = _hot_batch(64)
    want = _step(MoE(SPEC, _hot_weights()), x, dy)
    placements = [r[1] for r in results]
    assert placements[0] == placements[1] and (placements[0] is not None) == rebalance
    got = (torch.cat([r[0][0] for r in results]), torch.cat([r[0][1] for r in results]),
           {n: sum(r[0][2][n] for r in results) for n in want[2]})  # gradients: all-reduced, as DDP does
    _close(got, want)


def test_slot_rows_are_checked_against_the_experts_and_the_stored_rows():
    spec = MoESpec(hidden=5, ffn=3, experts=4, top_k=2, dtype=torch.float32)
    w13, w2 = torch.randn(3, 6, 5), torch.randn(3, 5, 3)
    ok = ExpertWeights.routed(spec, w13, w2, slot_rows=(0, 1, 2, 0))  # 4 slots over 3 stored rows
    assert ok.rows_of(slice(2, 4)) == (2, 0)
    with pytest.raises(ValueError, match=r"slot_rows must give a row >= 0 \(or -1: not stored\) for each "
                       "of the 4 experts, got 3"):
        ExpertWeights.routed(spec, w13, w2, slot_rows=(0, 1, 2))
    with pytest.raises(ValueError, match="lowest -2"):
        ExpertWeights.routed(spec, w13, w2, slot_rows=(0, 1, 2, -2))
    with pytest.raises(ValueError, match=r"ExpertWeights.w13 has shape \(3, 6, 5\), expected \(4, 6, 5\)"):
        ExpertWeights.routed(spec, w13, w2, slot_rows=(0, 1, 3, 0))  # row 3 is not stored


def test_a_rank_gathers_its_own_slots_and_their_gradients_reach_the_logical_experts():
    p = Placement((0, 1, 2, 0, 3, 1), experts=4, ranks=2)
    spec = MoESpec(hidden=5, ffn=3, experts=4, top_k=2, dtype=torch.float32)
    w13 = torch.randn(4, 6, 5, requires_grad=True)
    logical = ExpertWeights.routed(spec, w13, torch.randn(4, 5, 3))
    reference = w13.index_select(0, torch.tensor(p.phy2log))  # every slot, autograd's own gather
    full, mine = p.physical_weights(logical), p.slot_weights(logical).gathered(slice(3, 6))
    assert torch.equal(full.w13, reference)
    assert mine.w13.shape == reference.shape and torch.equal(mine.w13[3:], reference[3:])
    g = torch.zeros(6, 6, 5)
    g[3:] = torch.randn(3, 6, 5)  # a distributed path's gradient: zero outside its rank's slots
    (want,) = torch.autograd.grad(reference, w13, g)
    (got,) = torch.autograd.grad(mine.w13, w13, g)
    (every,) = torch.autograd.grad(full.w13, w13, g)
    assert torch.equal(got, want) and torch.equal(every, want)
    assert got[0].abs().sum() > 0 and got[2].abs().sum() == 0


# ---------------------------------------------------------------------------- commands


def _simulate(capsys, *extra):
    from hpmoe.cli import main

    assert main(["simulate", "--preset", "small", "--ep", "4", "--tokens", "256", "--dtype", "fp32",
                 "--hardware", "h100", "--routing", "hot", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_with_replicas_shortens_a_hot_step_and_says_what_it_placed(capsys):
    plain = _simulate(capsys)
    placed = _simulate(capsys, "--balance", "replicate:4")
    assert plain["expert_slots"] == 16 and placed["expert_slots"] == 20 and placed["balance"] == "replicate:4"
    assert placed["makespan_us"] < plain["makespan_us"]
    from hpmoe.cli import main

    assert main(["simulate", "--preset", "small", "--ep", "4", "--balance", "replicate:3"]) == 2
    assert "redundant=3" in capsys.readouterr().err  # 19 slots cannot divide over 4 ranks


def test_bench_with_a_placement_runs_the_physical_layer(tmp_path):
    argv = [sys.executable, "-m", "hpmoe", "bench", "--ep", "2", "--preset", "tiny", "--tokens", "32",
            "--routing", "hot", "--balance", "replicate:2", "--iters", "2", "--warmup", "1", "--json",
            "--dtype", "fp32", "--deadline", "30"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["balance"] == "replicate:2" and report["max_abs_diff"] < 1e-4


@pytest.mark.parametrize("calls", [1, FOLD - 1, FOLD, FOLD + 1, 2 * FOLD + 5])
def test_the_load_folded_in_bulk_is_the_moving_average_call_by_call(calls):
    layer = MoE(SPEC, ExpertWeights.random(SPEC, 0))
    g = torch.Generator().manual_seed(calls)
    want = torch.zeros(SPEC.experts, dtype=torch.float64)
    for i in range(calls):
        rows = torch.randint(0, 50, (SPEC.experts,), generator=g)
        layer._door.balance.measure(rows)
        want = want * LOAD_DECAY + rows.double() * (1.0 - LOAD_DECAY)
        if i == calls // 2:  # a read between calls folds what is kept
            torch.testing.assert_close(torch.from_numpy(layer.expert_load()), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.from_numpy(layer.expert_load()), want, rtol=1e-12, atol=1e-12)
    assert layer._door.balance.calls == calls

"""Sharded expert storage: the rows a move sends (against hand-made placements), its
modelled cost (hand arithmetic), the exchange on two gloo ranks (``torch.equal`` on rows
that say which expert they are), and sharded layers against the plain layer: outputs,
every logical gradient, and five Adam steps with a migration (and replicas) in the
middle, the optimizer's moments moved with the rows."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from hpmoe.migration import Moves, adam_row, move_rows
from hpmoe.nn.layer import MoE
from hpmoe.placement import Placement
from hpmoe.runtime.session import RuntimeConfig, Session
from hpmoe.sim.hardware import LinkEntry
from hpmoe.sim.presets import cpu_nominal
from hpmoe.spec import preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights

SPEC = preset("tiny", torch.float32)
TOL = dict(rtol=1e-5, atol=1e-5)
IDENTITY = Placement.identity(8, 2)
SWAP = Placement((0, 1, 2, 6, 3, 4, 5, 7), 8, 2)  # expert 6 to rank 0, expert 3 to rank 1
REPLICAS = Placement((0, 3, 4, 5, 7, 0, 1, 2, 6, 7), 8, 2)  # experts 0 and 7 on both ranks
REPACKED = Placement((0, 1, 2, 3, 7, 0, 4, 5, 6, 7), 8, 2)  # the same replicas, other experts moved


def test_a_move_copies_locally_what_a_rank_already_holds_and_fetches_the_rest():
    moves = Moves.between(IDENTITY, SWAP)
    assert moves.source[0] == ((0, 0), (0, 1), (0, 2), (1, 2))  # expert 6 is rank 1's row 2
    assert moves.source[1] == ((0, 3), (1, 0), (1, 1), (1, 3))
    assert moves.rows().tolist() == [[0, 1], [1, 0]]
    back = Moves.between(REPLICAS, REPACKED)  # 0, 3 and 7 stay (3 at another index), 1 and 2 come
    assert back.source[0] == ((0, 0), (1, 1), (1, 2), (0, 1), (0, 4))
    assert back.source[1] == ((1, 0), (0, 2), (0, 3), (1, 3), (1, 4))
    assert back.rows().tolist() == [[0, 2], [2, 0]]
    assert Moves.between(SWAP, SWAP).rows().sum() == 0
    with pytest.raises(ValueError, match="8 experts on 2 ranks in 8 slots -> 8 on 2 in 10"):
        Moves.between(IDENTITY, REPLICAS)


def test_the_modelled_cost_of_a_move_is_the_busiest_ranks_copies_and_direction_on_the_link():
    hw = cpu_nominal()  # 0.6 GB/s per rank and direction, 20 us per message, 10 GB/s copies
    one_way = Moves((((0, 0), (1, 0), (1, 1)), ((1, 0), (1, 1), (1, 2))))  # rank 1 sends 2 rows, gets none
    assert one_way.rows().tolist() == [[0, 0], [2, 0]]
    copies = 4 * 2 * 1000 / 10e9  # rank 0 receives 2 rows, rank 1 sends 2: each copied twice
    assert one_way.seconds(1000, 3, hw) == pytest.approx(copies + 3 * hw.link_latency + 2000 / 0.6e9)
    shifted = Moves((((0, 1), (0, 0)), ((1, 0), (1, 1))))  # rank 0 swaps its two rows: no link
    assert shifted.seconds(1000, 3, hw) == pytest.approx(4 * 2 * 1000 / 10e9)
    assert Moves.between(SWAP, SWAP).seconds(1000, 3, hw) == 0.0


def test_the_modelled_cost_of_replicas_is_a_gradient_copy_and_an_all_reduce_of_their_rows():
    from hpmoe.migration import replica_seconds

    hw = cpu_nominal()
    params = [torch.zeros(5, 6, 4), torch.zeros(5, 4, 3, dtype=torch.bfloat16)]  # 5 stored rows
    assert REPLICAS.spread == (0, 7)
    summed = 2 * (24 + 12) * 4  # experts 0 and 7, each row's 36 elements in fp32
    copied = 5 * 24 * 4 + 5 * 12 * 2 + 2 * summed
    expected = copied / hw.mem_bw + hw.link_latency + summed / 0.6e9  # a ring of 2: 2 (P - 1) / P = 1
    assert replica_seconds(params, REPLICAS, hw) == pytest.approx(expected)
    assert replica_seconds(params, SWAP, hw) == 0.0  # no expert on two ranks


def _exchange(rank, world, old, new):
    session = Session(RuntimeConfig(), dist.group.WORLD)
    per = old.slots_per_rank
    held = torch.tensor(old.phy2log[rank * per:(rank + 1) * per], dtype=torch.float32)
    w = held[:, None, None] * 1000 + torch.arange(6.0).view(1, 2, 3)  # a row says its expert
    m = held[:, None].to(torch.bfloat16).repeat(1, 5)
    try:
        move_rows([w, m], Moves.between(old, new), rank, session.collectives)
        return w, m
    finally:
        session.close()


@pytest.mark.parametrize("old, new", [(IDENTITY, SWAP), (SWAP, IDENTITY), (REPLICAS, REPACKED)])
def test_every_rank_ends_with_the_rows_of_its_new_experts(old, new):
    got = spawn_gloo(_exchange, 2, old, new)
    per = new.slots_per_rank
    for rank, (w, m) in enumerate(got):
        experts = torch.tensor(new.phy2log[rank * per:(rank + 1) * per], dtype=torch.float32)
        assert torch.equal(w, experts[:, None, None] * 1000 + torch.arange(6.0).view(1, 2, 3))
        assert m.dtype == torch.bfloat16
        assert torch.equal(m, experts[:, None].to(torch.bfloat16).expand(per, 5))


# ---------------------------------------------------------------------------- layers


def _weights(hot=0):
    """Every token picks expert ``hot`` first (its selection bias is large)."""
    w = ExpertWeights.random(SPEC, 1)
    bias = w.router_bias.clone()
    bias[hot] = 5.0
    return ExpertWeights(SPEC, w.router, bias, w.w13, w.w2, w.shared_w13, w.shared_w2)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(64, SPEC.hidden, generator=g), torch.randn(64, SPEC.hidden, generator=g)


def _train(layer, rank, world, move_at, redundant):
    """Five Adam steps on this rank's half of each batch; gradients of the replicated
    parameters (router, shared expert) all-reduced as DDP does, the stored expert rows'
    left as they are; a rebalance before step ``move_at``."""
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    outs, mine = [], slice(rank * 32, (rank + 1) * 32)
    for step in range(5):
        x, dy = _batch(step)
        if step == move_at:
            layer.rebalance(redundant=redundant, min_gain=1.0, optimizer=opt)
        opt.zero_grad()
        out = layer(x[mine])
        (out * dy[mine]).sum().backward()
        for name, p in layer.named_parameters():
            if not name.startswith("experts."):
                dist.all_reduce(p.grad)
        opt.step()
        outs.append(out.detach())
    state = opt.state[layer.experts.gate_up_proj]["exp_avg"]
    return outs, {n: p.detach().clone() for n, p in layer.named_parameters()}, state, layer.placement


def _sharded(rank, world, options, redundant):
    layer = MoE(SPEC, _weights(), ep_group=dist.group.WORLD, shard_experts=True, redundant=redundant,
                **options)
    assert layer.experts.gate_up_proj.shape[0] == (SPEC.experts + redundant) // world
    result = _train(layer, rank, world, move_at=2, redundant=redundant)
    layer.close()
    return result


def _plain():
    layer = MoE(SPEC, _weights())
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    outs = []
    for step in range(5):
        x, dy = _batch(step)
        opt.zero_grad()
        out = layer(x)
        (out * dy).sum().backward()
        opt.step()
        outs.append(out.detach())
    return outs, {n: p.detach() for n, p in layer.named_parameters()}, opt.state[layer.experts.gate_up_proj]


PATHS = {"kernel by kernel": {"backend": "kernel_by_kernel"}, "taskflow": {"schedule": None}}


@pytest.mark.parametrize("redundant", [0, 2])
@pytest.mark.parametrize("path", PATHS)
def test_a_sharded_layer_trains_as_the_plain_layer_through_a_migration(path, redundant):
    """Each rank stores its own slots; a rebalance before step 2 moves rows (and their
    Adam moments) between ranks, with ``redundant`` replicas whose gradients are summed
    over their holders: outputs of every step, every stored row after five steps and
    its moments equal the plain layer's logical expert's."""
    results = spawn_gloo(_sharded, 2, PATHS[path], redundant, timeout=180)
    outs, params, state = _plain()
    for step in range(5):
        torch.testing.assert_close(torch.cat([r[0][step] for r in results]), outs[step], **TOL)
    placement = results[0][3]
    assert placement == results[1][3] and placement is not None and placement.slots == 8 + redundant
    assert placement.spread == ((0,) if redundant else ())  # the hot expert on both ranks
    per = placement.slots_per_rank
    for rank, (_, got, moments, _) in enumerate(results):
        experts = list(placement.phy2log[rank * per:(rank + 1) * per])
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            torch.testing.assert_close(got[name], params[name][experts], **TOL, msg=name)
        torch.testing.assert_close(moments, state["exp_avg"][experts], **TOL)
        for name in ("gate.weight", "shared_experts.up_proj.weight"):
            torch.testing.assert_close(got[name], params[name], **TOL, msg=name)
    if redundant:  # the hot expert's rows stay bitwise equal on its two holders
        rows = [placement.phy2log[r * per:(r + 1) * per].index(0) for r in range(2)]
        assert torch.equal(*(results[r][1]["experts.gate_up_proj"][rows[r]] for r in range(2)))


def _spares(rank, world, options):
    layer = MoE(SPEC, _weights(), ep_group=dist.group.WORLD, shard_experts=True, redundant=2, **options)
    x, dy = _batch(0)
    (layer(x[rank * 32:(rank + 1) * 32]) * dy[rank * 32:(rank + 1) * 32]).sum().backward()
    placement, per = layer.placement, layer.placement.slots_per_rank
    mine = placement.phy2log[rank * per:(rank + 1) * per]
    spares = [j for j, e in enumerate(mine) if e in mine[:j]]
    grads = {n: p.grad for n, p in layer.named_parameters() if n.startswith("experts.")}
    layer.close()
    return placement, spares, grads


@pytest.mark.parametrize("path", PATHS)
def test_a_sharded_layer_starts_with_spares_that_take_no_tokens_and_no_all_reduce(path):
    """``redundant`` slots start as spares (a second slot of an expert on its own rank):
    no expert is on two ranks, so the backward sums nothing across ranks, and a spare's
    gradient rows are zero on every path."""
    results = spawn_gloo(_spares, 2, PATHS[path], timeout=120)
    placement = results[0][0]
    assert placement.spread == () and sorted(set(placement.phy2log)) == list(range(8))
    for _, spares, grads in results:
        assert len(spares) == 1
        for name, g in grads.items():
            assert torch.equal(g[spares], torch.zeros_like(g[spares])), name
            assert g.abs().sum() > 0, name


def _reset_and_copy(rank, world, redundant):
    """A sharded layer reset before and after a move, then deep-copied and the copy
    moved back: whether each reset drew the rows of the experts its slots hold, and
    whether the copy's state dict, saved after its move, holds the original's values."""
    layer = MoE(SPEC, ep_group=dist.group.WORLD, shard_experts=True, redundant=redundant, seed=4)
    w, drawn = ExpertWeights.random(SPEC, 4), []
    start = layer._door.balance.physical()
    for placement in (None, SWAP if redundant == 0 else REPLICAS):
        if placement is not None:
            layer.move_to(placement)
        with torch.no_grad():
            for p in layer.parameters():
                p.zero_()
        layer.reset_parameters()
        per = layer._door.balance.physical().slots_per_rank
        mine = list(layer._door.balance.physical().phy2log[rank * per:(rank + 1) * per])
        drawn += [torch.equal(layer.experts.gate_up_proj, w.w13[mine]),
                  torch.equal(layer.experts.down_proj, w.w2[mine]), torch.equal(layer.gate.weight, w.router)]
    copied = copy.deepcopy(layer)
    copied.move_to(start)
    state = copied.state_dict()
    same = [torch.equal(row, full[e:e + 1]) for name, full in (("gate_up_proj", w.w13), ("down_proj", w.w2))
            for row, e in zip(state[f"experts.{name}"].rows, state[f"experts.{name}"].experts, strict=True)]
    layer.close()
    copied.close()
    return drawn, all(same) and len(same) > 0


@pytest.mark.parametrize("redundant", [0, 2])
def test_a_sharded_layer_resets_its_stored_slots_rows_and_its_copy_saves_its_own_order(redundant):
    """``reset_parameters`` on a sharded layer draws, on each rank, the rows of the
    experts its slots hold under the placement now (the starting one, then after a move;
    two replicas included); a deep copy moved elsewhere saves the same logical state
    dict as the original (its state-dict hooks read its own placement)."""
    for drawn, same in spawn_gloo(_reset_and_copy, 2, redundant, timeout=120):
        assert all(drawn), drawn
        assert same


def _refusals(rank, world):
    group = dist.group.WORLD
    errors = []
    for options in ({"rebalance_every": 4}, {"runtime": RuntimeConfig(check_weights=True)}):
        try:
            MoE(SPEC, ep_group=group, shard_experts=True, **options)
        except ValueError as err:
            errors.append(str(err))
    layer = MoE(SPEC, ep_group=group, shard_experts=True)
    for attempt in (lambda: setattr(layer, "placement", SWAP), lambda: layer.rebalance(redundant=2),
                    lambda: layer.move_to(REPLICAS)):
        try:
            attempt()
        except ValueError as err:
            errors.append(str(err))
    layer(torch.randn(8, SPEC.hidden)).sum().backward()
    if rank == 0:
        layer.zero_grad()  # rank 1 keeps its gradients: the ranks' rows differ in what they carry
    try:
        layer.move_to(SWAP)
    except ValueError as err:
        errors.append(str(err))
    layer.close()
    return errors


def test_a_sharded_layer_refuses_what_it_cannot_do_naming_it():
    for errors in spawn_gloo(_refusals, 2):
        assert len(errors) == 6, errors
        assert "rebalance_every=4 with shard_experts" in errors[0]
        assert "shard_experts with RuntimeConfig.check_weights" in errors[1]
        assert "use layer.move_to(placement, optimizer)" in errors[2]
        assert "rebalance(redundant=2) on a layer with shard_experts, which stores redundant=0" in errors[3]
        assert "stores 8 slots (experts plus redundant=0): the placement has 10" in errors[4]
        assert "ranks carry different state per row" in errors[5]
    with pytest.raises(ValueError, match="shard_experts=True needs an ep_group"):
        MoE(SPEC, shard_experts=True)
    with pytest.raises(TypeError, match="shard_experts must be a bool, got 1"):
        MoE(SPEC, shard_experts=1)
    with pytest.raises(ValueError, match=r"rebalance\(steps=-1\) must be an int >= 0"):
        MoE(SPEC, virtual_ep=2).rebalance(steps=-1)


def test_a_gather_of_slots_not_stored_here_is_refused():
    spec = dataclasses.replace(SPEC, shared_experts=0)
    w13, w2 = torch.randn(4, 2 * spec.ffn, spec.hidden), torch.randn(4, spec.hidden, spec.ffn)
    w = ExpertWeights.routed(spec, w13, w2, slot_rows=(0, 1, 2, 3, -1, -1, -1, -1))
    assert torch.equal(w.gathered(slice(0, 4)).w13[:4], w.w13)
    with pytest.raises(ValueError, match="include slots not stored here"):
        w.gathered()


def test_a_training_row_carries_weights_master_copy_and_adam_moments():
    params = 3 * SPEC.hidden * SPEC.ffn
    assert adam_row(SPEC) == (params * 12, 6)  # fp32 weights, two fp32 moments
    bf16 = dataclasses.replace(SPEC, dtype=torch.bfloat16)
    assert adam_row(bf16) == (params * 14, 8)  # + an fp32 master copy
    biased = dataclasses.replace(SPEC, expert_bias=True)
    assert adam_row(biased) == ((params + 2 * SPEC.ffn + SPEC.hidden) * 12, 12)


def test_simulate_says_what_a_sharded_layer_would_move_to_balance(capsys):
    from hpmoe.cli import main
    from hpmoe.sim.hardware import LinkDirection
    from hpmoe.sim.presets import hardware_preset

    argv = ["simulate", "--preset", "small", "--ep", "4", "--tokens", "256", "--dtype", "fp32", "--hardware",
            "h100", "--routing", "hot", "--json"]
    assert main(argv) == 0 and "move" not in json.loads(capsys.readouterr().out)
    assert main([*argv, "--balance", "migrate"]) == 0
    move = json.loads(capsys.readouterr().out)["move"]
    small = preset("small", torch.float32)
    assert move["row_bytes"] == 3 * small.hidden * small.ffn * 12 and move["rows_per_rank"] >= 1
    link = hardware_preset("h100").link_bandwidth(4, LinkDirection.DISPATCH)
    assert move["predicted_us"] >= move["rows_per_rank"] * move["row_bytes"] / link * 1e6


def _gated(rank, world, link_bytes_per_s, steps):
    hw = dataclasses.replace(cpu_nominal(), link=(LinkEntry(2, link_bytes_per_s, link_bytes_per_s),))
    layer = MoE(SPEC, _weights(hot=7), ep_group=dist.group.WORLD, shard_experts=True, redundant=2,
                backend="kernel_by_kernel", hardware=hw)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    mine = slice(rank * 32, (rank + 1) * 32)
    for step in range(2):
        x, dy = _batch(step)
        opt.zero_grad()
        (layer(x[mine]) * dy[mine]).sum().backward()
        opt.step()
    before = layer.placement
    after = layer.rebalance(redundant=2, min_gain=1.0, optimizer=opt, steps=steps)
    layer.close()
    return before, after, layer._door.balance.clock.call_s


@pytest.mark.parametrize("link, steps, moves, replicas",
                         [(1.0, 10**6, False, False), (0.6e9, 10**6, True, True), (1.0, 0, True, False)])
def test_a_rebalance_moves_only_when_the_calls_it_serves_repay_the_move(link, steps, moves, replicas):
    """Two replicas for the hot expert 7 cut the busiest rank's load; over ``steps``
    calls of the measured time that repays a move on a 0.6 GB/s link, never one at
    1 byte/s (rows of 18 KB: hours each).  Without ``steps`` the predicted call decides
    alone: at 1 byte/s the replicas' gradient all-reduce would cost more than they save,
    so the plan only re-packs the experts (the extra slots spares)."""
    (before, after, call_s), other = spawn_gloo(_gated, 2, link, steps)
    assert call_s > 0 and other[1] == after and before.spread == ()
    assert (after != before) == moves and (7 in after.spread) == replicas

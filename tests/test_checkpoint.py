"""Checkpoints in logical expert order (``hpmoe.engine.checkpoint``, ``hpmoe.nn.checkpoint``):
a sharded layer's rows as DCP's logical rows (hand-made placements, rows that say which
expert they are), the resharding matrix (saved on 4 gloo ranks, loaded on 2, on 4 under
another placement, in one process: the same outputs and Adam moments), a resume that
gives the bits of the run that never stopped, and a rank killed in each stage of a move:
its peers name the stage within the deadline, keep the old placement and its rows,
nothing is left behind, and the last checkpoint resumes exactly."""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpmoe.engine.checkpoint import (
    BalanceState,
    LogicalRows,
    balance_state,
    held,
    logical_rows,
    restore,
    stored_rows,
)
from hpmoe.launch.launcher import LaunchSpec, launch
from hpmoe.migration import MoveStage
from hpmoe.nn.checkpoint import TrainState, logical_optimizer
from hpmoe.runtime.transport.segment import job_segments
from hpmoe.testing import spawn_gloo

from . import checkpoint_run as run


def _rows(experts: tuple[int, ...]) -> torch.Tensor:
    """[len(experts), 2, 3]: each row says its expert."""
    return torch.tensor(experts, dtype=torch.float32).view(-1, 1, 1) * 10 + torch.arange(6.0).view(1, 2, 3)


def test_logical_rows_hold_each_expert_once_and_fill_every_slot_back():
    held = (0, 0, 5, 3, 5)  # a spare of 0, expert 5 twice
    rows = logical_rows(_rows(held), held, 8)
    assert isinstance(rows, LogicalRows) and rows.shape == (8, 2, 3) and rows.experts == (0, 3, 5)
    assert [c.offsets[0] for c in rows.__create_chunk_list__()] == [0, 3, 5]
    assert torch.equal(torch.cat(rows.rows), _rows((0, 3, 5)))
    assert torch.equal(stored_rows(rows, (5, 3, 3, 0, 0), 8, "w"), _rows((5, 3, 3, 0, 0)))
    assert torch.equal(stored_rows(_rows(tuple(range(8))), held, 8, "w"), _rows(held))  # a full tensor
    with pytest.raises(ValueError, match=r"logical rows hold experts \(0, 3, 5\), .*\(missing \[1\]\)"):
        stored_rows(rows, (1, 3), 8, "w")
    with pytest.raises(ValueError, match=r"w: a state dict's expert tensor is \[experts=8, ...\]"):
        stored_rows(_rows(held), held, 8, "w")
    with pytest.raises(TypeError, match="save and load them through DCP"):
        rows.sum()


@pytest.mark.parametrize("options", [dict(virtual_ep=2, schedule=None), dict(backend="kernel_by_kernel"),
                                     dict(virtual_ep=2, backend="kernel_by_kernel", placement=True)])
def test_a_replaced_model_saves_in_its_familys_names_and_layout(options):
    """A tiny Qwen3-MoE model whose blocks were replaced (taskflow of 2 virtual ranks,
    kernel by kernel, kernel by kernel under a placement with replicas), after an Adam
    step: its state dict has transformers' keys, shapes and dtypes, and loads (strict)
    into the unreplaced model, which then computes the replaced model's logits."""
    transformers = pytest.importorskip("transformers")
    from hpmoe.nn.hf import tiny_qwen3_moe_config
    from hpmoe.nn.replace import replace_moe_blocks
    from hpmoe.placement import Placement

    torch.manual_seed(0)
    plain = transformers.Qwen3MoeForCausalLM(tiny_qwen3_moe_config(num_hidden_layers=2))
    model = copy.deepcopy(plain)
    replicas = options.pop("placement", False)
    names = replace_moe_blocks(model, **options).names
    if replicas:
        for name in names:
            model.get_submodule(name).placement = Placement((0, 1, 2, 3, 7, 4, 5, 6, 7, 0), 8, 2)
    ids = torch.arange(24).view(2, 12) % 64
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    state, reference = model.state_dict(), plain.state_dict()
    assert list(state) == list(reference)
    assert all((v.shape, v.dtype) == (reference[k].shape, reference[k].dtype) for k, v in state.items())
    plain.load_state_dict(state, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_a_saved_balance_is_adopted_only_by_a_layer_of_its_layout():
    """One process: a layer's placement (replicas), measured load and call count saved;
    a layer of the same virtual EP adopts all three, one of another EP size only the
    load and count and keeps its own placement."""
    from hpmoe.nn.layer import MoE
    from hpmoe.placement import Placement

    replicas = Placement((0, 1, 2, 3, 7, 4, 5, 6, 7, 0), 8, 2)
    layer = MoE(run.SPEC, virtual_ep=2, backend="kernel_by_kernel")
    layer.placement = replicas
    layer(run.probe(1, 0))
    state = balance_state(layer._door.balance)
    assert state.calls == 1 and state.load.shape == (1, 8) and state.load.sum() > 0
    for ep, placement in ((2, replicas), (4, None)):
        other = MoE(run.SPEC, virtual_ep=ep, backend="kernel_by_kernel")
        restore(other._door.balance, state, [], None)
        assert other.placement == placement and other._door.balance.calls == 1
        assert (other.expert_load() == state.load[0]).all()


def _data_parallel(rank: int, world: int, path: str) -> dict[str, bool]:
    """Per wrapper: two Adam steps, a save through ``TrainState``, a third step; a fresh
    wrapped model loads and runs the third step: whether its output and parameters equal
    the first's bit for bit."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    def wrapped(wrap: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = run.build(1)
        if wrap == "ddp":
            model = DistributedDataParallel(model)
        else:
            mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
            for module in (*model, model):
                fully_shard(module, mesh=mesh)
        return model, run.optimizer(model)

    def one_step(model: torch.nn.Module, opt: torch.optim.Optimizer, s: int) -> torch.Tensor:
        x, dy = run.batch(s, world, rank)
        opt.zero_grad()
        out = model(x)
        (out * dy).sum().backward()
        opt.step()
        return out.detach()

    same = {}
    for wrap in ("ddp", "fsdp2"):
        model, opt = wrapped(wrap)
        for s in range(2):
            one_step(model, opt, s)
        dcp.save({"train": TrainState(model, opt)}, checkpoint_id=f"{path}/{wrap}")
        want = one_step(model, opt, 2)
        fresh, fresh_opt = wrapped(wrap)
        dcp.load({"train": TrainState(fresh, fresh_opt)}, checkpoint_id=f"{path}/{wrap}")
        got = one_step(fresh, fresh_opt, 2)
        params = zip(fresh.parameters(), model.parameters(), strict=True)
        same[wrap] = torch.equal(got, want) and all(_full(a).equal(_full(b)) for a, b in params)
    return same


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def test_a_ddp_or_fsdp2_model_resumes_exactly_through_train_state(tmp_path):
    """DDP and FSDP2 over a model of two hpmoe layers (every rank a full copy, or FSDP2's
    shards): saved after two steps, loaded by fresh wrapped models, the third step gives
    the bits of the model that went on."""
    for same in spawn_gloo(_data_parallel, 2, str(tmp_path), timeout=240):
        assert same == {"ddp": True, "fsdp2": True}


def _held(model: torch.nn.Module) -> tuple[int, ...]:
    return held(model[1]._door.balance)


def _probe(model: torch.nn.Module, world: int, rank: int) -> torch.Tensor:
    """The model's output on the probe batch, leaving its measured load as it was (the
    balance saved and restored: the next rebalance plans as without the probe)."""
    states = [balance_state(m._door.balance) for m in model]
    with torch.no_grad():
        out = model(run.probe(world, rank))
    for m, state in zip(model, states, strict=True):
        restore(m._door.balance, state, list(m.experts.parameters()), None)
    return out


def _uninterrupted(rank: int, world: int, path: str) -> dict:
    """Leg 0 (a rebalance, a move to replicas and spares), a save, the probe, leg 1."""
    model = run.build(world)
    opt = run.optimizer(model)
    run.leg(model, opt, rank, world, 0)
    run.save(model, opt, path)
    state = model[1].state_dict()["experts.gate_up_proj"]
    assert isinstance(state, LogicalRows) and state.experts == tuple(sorted(set(_held(model))))
    saved, probe = run.logical(model, opt), _probe(model, world, rank)
    outs = run.leg(model, opt, rank, world, 1)
    return dict(saved=saved, probe=probe, outs=outs, logical=run.logical(model, opt),
                placements=run.placements(model))


def _resumed(rank: int, world: int, path: str) -> dict:
    """Fresh processes: at EP 4 first a load through DCP's own state dicts with the
    sharded layer under another placement (kept), then ``TrainState``'s load (the saved
    placements adopted) and leg 1."""
    model = run.build(world)
    opt = run.optimizer(model)
    other = {}
    if world == 4:
        model[1].move_to(run.MOVES[world][1])
        logical_optimizer(model, opt)
        model_state, optim_state = get_state_dict(model, opt)
        dcp.load({"train": {"model": model_state, "optim": optim_state}}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)
        other = dict(placements=run.placements(model), logical=run.logical(model, opt),
                     probe=_probe(model, world, rank))
    run.load(model, opt, path)
    outs = run.leg(model, opt, rank, world, 1)
    return dict(other=other, outs=outs, logical=run.logical(model, opt), placements=run.placements(model))


def _loaded_at(rank: int, world: int, path: str) -> dict:
    """A fresh model of ``world`` ranks (1: one process, full storage) loaded through
    ``TrainState``: its placements, logical state and probe."""
    model = run.build(world)
    opt = run.optimizer(model)
    run.load(model, opt, path)
    return dict(placements=run.placements(model), logical=run.logical(model, opt),
                probe=_probe(model, world, rank))


@functools.cache
def _reference(world: int, base: str) -> list[dict]:
    return spawn_gloo(_uninterrupted, world, f"{base}/ckpt{world}", timeout=240)


@functools.cache
def _resume(world: int, base: str) -> list[dict]:
    _reference(world, base)
    return spawn_gloo(_resumed, world, f"{base}/ckpt{world}", timeout=240)


@pytest.mark.parametrize("target", ["ep2", "ep4 other placement", "one process"])
def test_a_sharded_checkpoint_saved_on_4_ranks_loads_resharded(target, tmp_path_factory):
    """Saved at EP 4 after a rebalance and a move (replicas, spares), loaded at EP 2
    (``TrainState``: the saved placements are for 4 ranks, the layers keep theirs), at
    EP 4 with the sharded layer under another placement (DCP's own ``get_state_dict`` /
    ``set_state_dict``: the rows land where that placement wants them), and in one
    process into full storage: the same outputs on a batch no step trained on (within
    1e-6 of their largest: other EP sizes and placements run GEMMs of other row counts)
    and every parameter and Adam moment bitwise equal in logical order."""
    base = str(tmp_path_factory.getbasetemp())
    saved = _reference(4, base)
    if target == "ep2":
        ranks = spawn_gloo(_loaded_at, 2, f"{base}/ckpt4", timeout=240)
        assert ranks[0]["placements"][1] != saved[0]["placements"][1]  # EP 2's own
    elif target == "one process":
        ranks = [_loaded_at(0, 1, f"{base}/ckpt4")]
    else:
        ranks = [r["other"] for r in _resume(4, base)]
        assert ranks[0]["placements"][1] == run.MOVES[4][1]  # kept, the rows that placement's
    want = torch.cat([r["probe"] for r in saved])
    torch.testing.assert_close(torch.cat([r["probe"] for r in ranks]), want, rtol=0.0,
                               atol=1e-6 * want.abs().max().item())
    assert ranks[0]["logical"].keys() == saved[0]["saved"].keys()
    for name, t in saved[0]["saved"].items():
        assert torch.equal(ranks[0]["logical"][name], t), name


def _assert_bitwise(resumed: list[dict], reference: list[dict]) -> None:
    for got, want in zip(resumed, reference, strict=True):
        assert got["placements"] == want["placements"]
        for a, b in zip(got["outs"], want["outs"], strict=True):
            assert torch.equal(a, b)
        for name, t in want["logical"].items():
            assert torch.equal(got["logical"][name], t), name


@pytest.mark.parametrize("world", [2, 4])
def test_a_run_killed_after_a_save_resumes_with_the_bits_of_one_that_never_stopped(world, tmp_path_factory):
    """N steps with a rebalance and a move, a save, the processes gone; fresh processes
    load and run M steps with another rebalance and move: every output, parameter,
    Adam moment and placement bitwise the run's that went on after its save."""
    base = str(tmp_path_factory.getbasetemp())
    reference = _reference(world, base)
    assert reference[0]["placements"][1] == run.MOVES[world][1]
    assert reference[0]["placements"][0] is not None and reference[0]["placements"][0].spread  # replicas
    _assert_bitwise(_resume(world, base), reference)


# ---------------------------------------------------------------------------- a killed move


def _contents(path: str) -> dict:
    """A DCP checkpoint's every entry, read in this process (rows assembled)."""
    out = f"{path}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _same(a: Any, b: Any) -> bool:
    """Whether two checkpoint entries are equal, tensors and loads bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, BalanceState):
        return (a.phy2log, a.ranks, a.nodes, a.calls) == (b.phy2log, b.ranks, b.nodes, b.calls) and \
            a.load.tobytes() == b.load.tobytes()
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("world, stage", [(2, MoveStage.AGREEMENT), (2, MoveStage.EXCHANGE),
                                          (2, MoveStage.COMMIT), (4, MoveStage.EXCHANGE)])
def test_a_rank_killed_in_a_move_is_named_and_the_last_checkpoint_resumes(world, stage, tmp_path,
                                                                           tmp_path_factory):
    """Rank 1 SIGKILLs itself in ``stage`` of the sharded layer's move: every other rank
    ends with a ``MoveError`` naming the stage within the deadline + 5 s, its placement
    and every row it stored (weights, gradients, moments) the old ones; no process and
    no shared segment is left.  The checkpoint saved before the move holds the bits of
    the uninterrupted run's (whose resume is exact, above); on 2 ranks, killed in the
    all-to-all, fresh processes resume it with the bits of the run that never stopped."""
    argv = (sys.executable, "-m", "tests.checkpoint_run", stage.name, str(tmp_path / "ckpt"))
    result = launch(LaunchSpec(argv=argv, world=world, capture=True, timeout_s=180.0, grace_s=10.0))
    assert job_segments(result.job) == []
    assert all(r.returncode is not None for r in result.ranks)
    killed = result.ranks[run.KILLED]
    assert killed.returncode == -9, killed.stderr
    for peer in result.ranks:
        if peer.rank == run.KILLED:
            continue
        assert peer.returncode == 1, peer.stderr
        lines = peer.stderr.splitlines()
        line = next(x for x in lines if x.startswith("move failed after "))
        assert "MoveError" in line and stage.value in line and f"({stage.name})" in line, line
        assert float(line.split()[3]) < run.DEADLINE + 5.0, line
        assert f"stage {stage.name}; old placement in effect: True; old rows intact: True" in lines
    base = str(tmp_path_factory.getbasetemp())
    reference = _reference(world, base)
    got, want = _contents(str(tmp_path / "ckpt")), _contents(f"{base}/ckpt{world}")
    assert got.keys() == want.keys() and [k for k in want if not _same(got[k], want[k])] == []
    if world == 2 and stage is MoveStage.EXCHANGE:
        _assert_bitwise(spawn_gloo(_resumed, world, str(tmp_path / "ckpt"), timeout=240), reference)

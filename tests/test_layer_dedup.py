"""hpmoe.MoE with deduplicated tiles (``DispatchMode.PER_RANK`` and ``PER_NODE``): the
layer runs the deduplicated regions — the exact executors in one process, the runtime on
an EP group — bitwise as ``moe_forward_backward`` does, within fp32 tolerance of autograd
and of the per-expert layer; AUTO still picks the path."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from hpmoe.engine import ExactPath, KernelByKernelPath, RuntimePath
from hpmoe.exec.exact_backward import moe_forward_backward
from hpmoe.nn.layer import MoE
from hpmoe.routing import route
from hpmoe.runtime import RuntimeConfig, TransportKind
from hpmoe.schedule import SchedulePolicy
from hpmoe.schedule.auto import KERNEL_BY_KERNEL, Path, Reason
from hpmoe.sim.presets import cpu_nominal, hardware_preset
from hpmoe.spec import DispatchMode, as_recompute, preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights

from .helpers import TINY_TILES, ran
from .test_layer import TOL, _assert_close_runs, _data, _reference, _run

PER_RANK = replace(TINY_TILES, dispatch=DispatchMode.PER_RANK)
TILES = {"per-rank": PER_RANK, "per-rank-bf16-wire": replace(PER_RANK, partial_dtype=torch.bfloat16),
         "per-node": replace(TINY_TILES, dispatch=DispatchMode.PER_NODE)}


def _layer(tiles, ep, nodes=1, **options):
    spec = preset("tiny")
    return MoE(spec, ExpertWeights.random(spec, 1), virtual_ep=ep, tiles=tiles, nodes=nodes, **options)


@pytest.mark.parametrize("ep,nodes", [(2, 1), (4, 2)])
@pytest.mark.parametrize("mode", ["per-rank", "per-node"])
def test_one_process_equals_the_dedup_executors_and_autograd(mode, ep, nodes):
    layer = _layer(TILES[mode], ep, nodes, schedule=None)
    x, dy = _data(layer.spec, 16)
    got = _run(layer, x, dy)
    ran(layer, ExactPath, ep=ep, tiles=TILES[mode], nodes=nodes, order=None)
    flat = x.reshape(-1, layer.spec.hidden)
    with torch.no_grad():
        w = layer.expert_weights()
        routing = route(flat, w)
        want = moe_forward_backward(flat, w, routing, dy.reshape(flat.shape), ep, TILES[mode], nodes=nodes)
    assert torch.equal(got[0].reshape(flat.shape), want.out)
    assert torch.equal(got[2]["experts.gate_up_proj"], want.backward.grads.dw13)
    assert torch.equal(got[2]["experts.down_proj"], want.backward.grads.dw2)
    layer.zero_grad()
    _assert_close_runs(got, _reference(layer, x, dy), torch.float32)
    per_expert = _layer(TINY_TILES, ep, schedule=None)
    _assert_close_runs(got, _run(per_expert, x, dy), torch.float32)
    ran(per_expert, ExactPath, ep=ep, tiles=TINY_TILES)


@pytest.mark.parametrize("mode", list(TILES))
def test_recompute_and_task_order_leave_every_bit_unchanged(mode):
    x, dy = _data(preset("tiny"), 24, seed=3)
    base = _run(_layer(TILES[mode], 4, 2, schedule=None), x, dy)
    for options in [dict(recompute=True, schedule=None), dict(schedule=7), dict(schedule=8, recompute=True)]:
        layer = _layer(TILES[mode], 4, 2, **options)
        got = _run(layer, x, dy)
        ran(layer, ExactPath, ep=4, nodes=2, tiles=TILES[mode], order=options["schedule"],
            **{k: as_recompute(options[k]) for k in ("recompute",) if k in options})  # as asked
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1]), options
        assert all(torch.equal(got[2][n], base[2][n]) for n in base[2]), options


def test_auto_still_picks_the_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HPMOE_PROFILE", str(tmp_path / "none.json"))
    x, dy = _data(preset("tiny"), 16)
    auto = _layer(TILES["per-rank"], 2)
    got = _run(auto, x, dy)
    assert auto.decision(16).chosen.path is Path.KERNEL_BY_KERNEL  # no profile: tiles play no part
    per_expert = _layer(TINY_TILES, 2)
    want = _run(per_expert, x, dy)
    ran([auto, per_expert], KernelByKernelPath)
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[2][n], want[2][n]) for n in want[2])

    from hpmoe.schedule import auto as auto_module

    flow = auto_module.Candidate(Path.TASKFLOW, SchedulePolicy.SERIAL)
    decision = auto_module.AutoDecision(flow, KERNEL_BY_KERNEL, (), Reason.FORECAST_GAIN, 2.0)
    monkeypatch.setattr(auto_module, "layer_decision", lambda *args: decision)
    forecast, fixed = _layer(TILES["per-rank"], 2), _layer(TILES["per-rank"], 2, schedule=None)
    got, want = _run(forecast, x, dy), _run(fixed, x, dy)  # the taskflow, deduplicated
    ran([forecast, fixed], ExactPath, ep=2, tiles=TILES["per-rank"], order=None)
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[2][n], want[2][n]) for n in want[2])


def test_auto_forecasts_the_deduplicated_taskflow():
    h100 = hardware_preset("h100")
    flows, kbks = [], []
    for tiles in (TINY_TILES, TILES["per-rank"]):
        forecasts = _layer(tiles, 4, hardware=h100).decision(64, backward=True).forecasts
        flows += [f.region_s for f in forecasts if f.candidate.path is Path.TASKFLOW]
        kbks += [f.region_s for f in forecasts if f.candidate.path is Path.KERNEL_BY_KERNEL]
    assert len(flows) == 2 and flows[0] != flows[1]  # a different graph was forecast
    assert kbks[0] == kbks[1]  # the kernel-by-kernel path ignores the tiles


def test_the_triton_backend_refuses_deduplicated_tiles_by_name():
    with pytest.raises(ValueError, match=r"TileSpec.dispatch='per-rank': the triton backend"):
        MoE(preset("tiny"), tiles=TILES["per-rank"], backend="triton", schedule=None)


# ---------------------------------------------------------------------------- distributed


def _rank_step(rank, world, mode, nodes, options):
    """One forward/backward of an EP-group layer with deduplicated tiles on this rank's tokens."""
    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD, tiles=TILES[mode],
                nodes=nodes, **options)
    x, dy = _data(spec, 6 * world)
    shares = (t.reshape(world, -1, spec.hidden)[rank] for t in (x, dy))
    result = _run(layer, *shares)
    policy = options["schedule"] or SchedulePolicy.HYPERPARALLEL  # None: HYPERPARALLEL
    ran(layer, RuntimePath, tokens=6, policy=policy, tiles=TILES[mode], nodes=nodes,
        **{k: as_recompute(options[k]) for k in ("recompute",) if k in options})  # as asked
    layer.close()
    return result


TWO_TIER = replace(cpu_nominal(), inter_link_bw=2.5e8, inter_latency=2e-6)  # CRITICAL_PATH's model of 2 nodes
RUNS = {
    "2-per-rank-bf16-wire-shm": (2, "per-rank-bf16-wire", 1, dict(schedule=SchedulePolicy.HYPERPARALLEL)),
    "2-per-node-dist-recompute": (2, "per-node", 2, dict(
        schedule=SchedulePolicy.CRITICAL_PATH, recompute=True, hardware=TWO_TIER,
        runtime=RuntimeConfig(transport=TransportKind.DIST))),
    "4-per-node-shm-gemm": (4, "per-node", 2, dict(schedule=None, recompute="gemm")),  # rows travel again
}


@pytest.mark.parametrize("run", list(RUNS))
def test_distributed_ranks_on_the_runtime_equal_virtual_ranks(run):
    world, mode, nodes, options = RUNS[run]
    results = spawn_gloo(_rank_step, world, mode, nodes, options, timeout=180)
    spec = preset("tiny")
    x, dy = _data(spec, 6 * world)
    virtual = _layer(TILES[mode], world, nodes, schedule=None)
    want = _run(virtual, x.reshape(world, -1, spec.hidden), dy.reshape(world, -1, spec.hidden))
    ran(virtual, ExactPath, ep=world, nodes=nodes, tiles=TILES[mode])
    assert torch.equal(torch.stack([r[0] for r in results]), want[0])
    assert torch.equal(torch.stack([r[1] for r in results]), want[1])
    for name, grad in want[2].items():
        total = sum(r[2][name] for r in results)  # expert grads: zero off the owner
        if name.startswith("gate"):  # router grads: per-rank GEMMs, summed
            torch.testing.assert_close(total, grad, **TOL[torch.float32])
        else:
            assert torch.equal(total, grad), name

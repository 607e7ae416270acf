"""Every distributed layer call opens with one agreement, on the default path (AUTO
without a profile: kernel by kernel) as on every explicit path (the runtime taskflow
under each schedule policy, per expert and deduplicated): a rank's bad input (a NaN, an
expert id out of range) or ranks that disagree on dtype end every rank with the same
named error, and the next call starts in step; a rank stopped before the call, or inside
the path after the agreement (before its first exchange), ends its peer with a stall
report naming it within the deadline.  (Ranks whose layers differ in hidden size cannot
build the same input; top-k stands for a shape the fingerprint compares.)"""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from hpmoe import refs
from hpmoe.engine import ExactPath
from hpmoe.launch.launcher import LaunchSpec, launch
from hpmoe.nn.layer import MoE
from hpmoe.routing import route
from hpmoe.runtime import RuntimeConfig
from hpmoe.runtime.transport.segment import job_segments
from hpmoe.spec import preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights

from .helpers import TINY_TILES, ran
from .layer_fault_rank import DEADLINE as STALL_DEADLINE
from .layer_fault_rank import inputs as stall_inputs
from .layer_fault_rank import path_options, path_ran

DEADLINE = 3.0
PATHS = ["auto", "serial", "hyperparallel", "critical-path", "per-rank"]  # auto: kernel by kernel
TOKENS = 6


def _layer(path: str, dtype: torch.dtype = torch.float32) -> MoE:
    spec = preset("tiny", dtype)
    policy, tiles = path_options(path, TINY_TILES)
    return MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD, tiles=tiles,
               schedule=policy, runtime=RuntimeConfig(deadline_s=DEADLINE))


def _x(world: int) -> torch.Tensor:
    return torch.randn(world * TOKENS, preset("tiny").hidden, generator=torch.Generator().manual_seed(3))


def _error(call) -> str:
    try:
        call()
    except Exception as err:  # what each rank raised, compared across ranks by the test
        return f"{type(err).__name__}: {err}"
    return "no error"


def _bad_inputs_then_a_clean_step(rank: int, world: int, path: str) -> dict:
    layer, x = _layer(path), _x(world)
    mine = x[rank * TOKENS:(rank + 1) * TOKENS].clone().requires_grad_()
    nan = mine.detach().clone()
    if rank == 1:
        nan[5, 0] = float("nan")
    ids = torch.zeros(TOKENS, layer.spec.top_k, dtype=torch.int64)
    ids[2, 1] = 99 if rank == 0 else 0
    weights = torch.full((TOKENS, layer.spec.top_k), 0.5)
    zeros = torch.zeros_like(nan)
    got = {"nan": _error(lambda: layer(nan)), "ids": _error(lambda: layer.region(zeros, ids, weights))}
    with torch.set_grad_enabled(rank == 1):  # rank 0 evaluates, rank 1 trains: no backward in step
        got["grad"] = _error(lambda: layer(mine))
    out = layer(mine)
    out.backward(torch.ones_like(out))
    got |= {"out": out.detach(), "dx": mine.grad}
    kind, fields = path_ran(path, TINY_TILES)
    ran(layer, kind, **fields)
    bf16 = _layer(path, torch.bfloat16 if rank == 1 else torch.float32)
    got["dtype"] = _error(lambda: bf16(mine.detach()))
    spec = replace(preset("tiny"), top_k=3 if rank == 1 else 2)
    policy, tiles = path_options(path, TINY_TILES)
    other = MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD, tiles=tiles,
                schedule=policy, runtime=RuntimeConfig(deadline_s=DEADLINE))
    got["shape"] = _error(lambda: other(mine.detach()))
    for m in (layer, bf16, other):
        m.close()
    return got


@pytest.mark.parametrize("path", PATHS)
def test_bad_input_on_one_rank_is_named_on_every_rank_and_the_next_step_runs_in_step(path):
    ranks = spawn_gloo(_bad_inputs_then_a_clean_step, 2, path, timeout=180)
    for key, want in (("nan", "rank 1 rejected its input: x has NaN at row 5"),
                      ("ids", "rank 0 rejected its input: routing.ids contains expert id 99, outside [0, 8)"),
                      ("dtype", "dtype differs: rank 0 float32, rank 1 bfloat16"),
                      ("shape", "top_k differs: rank 0 2, rank 1 3"),
                      ("grad", "backward differs: rank 0 records none (no_grad, or nothing requires a "
                               "gradient), rank 1 records a backward")):
        assert ranks[0][key] == ranks[1][key], key
        assert want in ranks[0][key], ranks[0][key]
    assert ranks[0]["nan"].startswith("InputRejected") and ranks[0]["dtype"].startswith("MismatchError")
    assert ranks[0]["shape"].startswith("MismatchError") and ranks[0]["grad"].startswith("MismatchError")
    tiles = path_options(path, TINY_TILES)[1]
    whole = MoE(preset("tiny"), ExpertWeights.random(preset("tiny"), 1), tiles=tiles, schedule=None)
    x = _x(2).requires_grad_()
    out = whole(x)
    out.backward(torch.ones_like(out))
    ran(whole, ExactPath, ep=1, tiles=tiles)
    torch.testing.assert_close(torch.cat([r["out"] for r in ranks]), out.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([r["dx"] for r in ranks]), x.grad, atol=1e-5, rtol=1e-5)


# stopped before the call, a rank misses the agreement, which every path opens alike before
# it is chosen: one path stands for all there
STOPS = [("auto", "before-call")] + [(path, "inside-path") for path in PATHS]


@pytest.mark.parametrize(("path", "where"), STOPS, ids=[f"{p}-{w}" for p, w in STOPS])
def test_a_stopped_rank_is_named_by_its_peer_within_the_deadline(path, where, tmp_path):
    argv = (sys.executable, "-m", "tests.layer_fault_rank", path, where, str(tmp_path))
    # the stopped rank never reports: 2 s of grace after the peer's diagnosis, then it is killed
    result = launch(LaunchSpec(argv=argv, world=2, capture=True, timeout_s=90.0, grace_s=2.0))
    assert job_segments(result.job) == []
    stalled, peer = result.ranks[1], result.ranks[0]
    assert stalled.stopped and peer.returncode == 1, peer.stderr
    line = next(x for x in peer.stderr.splitlines() if x.startswith("diagnosed after "))
    # stopped inside the path, rank 1 misses the path's first exchange (the call's agreement
    # is the only one and has passed): kernel by kernel's dispatch (the agreement carried its
    # counts), the runtime's count exchange, or the deduplicated runtime's routing exchange
    first = {"auto": "kernel by kernel: d.dispatch", "per-rank": "forward region 2: routing exchange"}
    stage = first.get(path, "forward region 2: count exchange") if where == "inside-path" else "agreement"
    assert "CollectiveError" in line and "rank 1 did not arrive" in line and stage in line, line
    # diagnosed at the 2 s deadline plus at most a poll (50 ms) and the report; 5 s past it
    # is 100 polls: a margin a loaded host does not use up, the call's own cost included
    assert float(line.split()[2]) < STALL_DEADLINE + 5.0
    assert "(stopped or hung)" in peer.stderr
    for rank in range(2):  # the clean call before the stop, on each rank
        x, w = stall_inputs(rank)
        torch.testing.assert_close(torch.load(tmp_path / f"rank{rank}.pt"), refs.dense_moe(x, w, route(x, w)),
                                   atol=1e-5, rtol=1e-5)

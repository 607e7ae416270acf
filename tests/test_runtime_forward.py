"""The forward region on real gloo ranks (2 and 4, both transports, every schedule
policy, every routing generator): outputs and symmetric buffers bitwise equal to the
exact single-process executor, outputs close to the serialized torch.distributed
baseline, the same schedule on every rank, nothing left in /dev/shm."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import torch
import torch.distributed as dist

from hpmoe.exec.exact import execute_forward
from hpmoe.refs import serialized_ep_forward
from hpmoe.routing import Routing, RoutingKind, synthetic_routing
from hpmoe.runtime import ForwardOptions, ForwardRunner, RuntimeConfig, Session, TransportKind
from hpmoe.runtime.transport.segment import SHM_DIR
from hpmoe.schedule import QUEUE_POLICIES, SchedulePolicy
from hpmoe.sim.presets import cpu_nominal
from hpmoe.spec import ParallelSpec, TileSpec, preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights

from .handmade import UNIT_HW

TOKENS = 20  # not a multiple of the tile rows: partial tiles everywhere
TILES = TileSpec(rows=8, gemm_rows=8, gemm_cols=16)


def _inputs(kind: RoutingKind, ep: int, dtype: torch.dtype, seed: int):
    """Rows reveal their origin: column 0 holds the source rank + 1, column 1 the token's
    index on it (exact in bf16), so a misrouted row names where it came from."""
    moe = preset("tiny", dtype)
    par = ParallelSpec(ep=ep, tokens_per_rank=TOKENS)
    x = torch.randn(ep * TOKENS, moe.hidden, generator=torch.Generator().manual_seed(seed))
    x[:, 0] = torch.arange(ep).repeat_interleave(TOKENS) + 1.0
    x[:, 1] = torch.arange(TOKENS).repeat(ep).float()
    return x.to(dtype), synthetic_routing(kind, moe, par, seed=seed), ExpertWeights.random(moe, seed=seed)


def _origin(rows: torch.Tensor, i: int) -> str:
    return f"rank {int(rows[i, 0]) - 1} token {int(rows[i, 1])}"


def _moved(field: str, got: torch.Tensor, want: torch.Tensor) -> str:
    """Why a moved buffer differs: for received rows, where the first wrong row came from."""
    bad = int((got != want).any(dim=1).nonzero()[0])
    where = f": row {bad} holds {_origin(got, bad)}, expected {_origin(want, bad)}" if field == "recv" else ""
    return f"{field} differs from the exact executor{where}"


def _check(runner_of, kinds, policies, dtype, group, rank, ep) -> tuple[list[str], list[str]]:
    """Run every (policy, routing) on the group; (failures, schedule digests)."""
    failures, digests = [], []
    for seed, kind in enumerate(kinds):
        x, routing, weights = _inputs(kind, ep, dtype, seed)
        exact = execute_forward(x, weights, routing, ep, TILES)
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
        local = Routing(routing.ids[mine], routing.weights[mine])
        ref = serialized_ep_forward(x[mine], weights, local, group).out
        for policy in policies:
            out = runner_of(weights, policy)(x[mine], local)
            name = f"{policy.value}/{kind.value}/{dtype}"
            for field, got, want in (("out", out.out, exact.out[mine]),
                                     ("recv", out.buffers.recv, exact.buffers[rank].recv),
                                     ("comb", out.buffers.comb, exact.buffers[rank].comb)):
                if not torch.equal(got, want):
                    failures.append(f"rank {rank} {name}: {_moved(field, got, want)}")
            torch.testing.assert_close(out.out, ref)
            s = out.schedule
            digests.append(hashlib.sha256(s.queue_task.tobytes() + s.worker.tobytes()).hexdigest())
    return failures, digests


def _ranks(rank: int, world: int, transports: list[str], kinds: list[str], policies: list[str],
           workers: tuple[int, int], dtype: torch.dtype) -> dict:
    """Body of every rank: each transport, every routing, every policy, in one session each."""
    failures, digests = [], []
    for transport in map(TransportKind, transports):
        config = RuntimeConfig(transport=transport, deadline_s=20.0)
        hardware = replace(UNIT_HW, matrix_workers=workers[0], vector_workers=workers[1])
        with Session(config) as session:
            def runner_of(weights, policy, session=session, hardware=hardware):
                return ForwardRunner(session, weights, ForwardOptions(
                    tiles=TILES, policy=policy, hardware=hardware))
            f, d = _check(runner_of, list(map(RoutingKind, kinds)), list(map(SchedulePolicy, policies)),
                          dtype, None, rank, world)
            failures += f
            digests += d
    return {"failures": failures, "digests": digests}


def _no_segments() -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob("hpmoe-*"))


ALL_KINDS = [k.value for k in RoutingKind]
ALL_POLICIES = [p.value for p in QUEUE_POLICIES]


def test_two_ranks_every_transport_policy_and_routing_are_exact() -> None:
    before = _no_segments()
    results = spawn_gloo(_ranks, 2, ["shm", "dist"], ALL_KINDS, ALL_POLICIES, (1, 2), torch.float32,
                         timeout=120)
    assert [f for r in results for f in r["failures"]] == []
    assert results[0]["digests"] == results[1]["digests"]
    assert _no_segments() == before


def test_four_ranks_bf16_are_exact() -> None:
    before = _no_segments()
    kinds = [RoutingKind.ZIPF.value, RoutingKind.EMPTY_RANK.value, RoutingKind.HOT.value]
    policies = [SchedulePolicy.HYPERPARALLEL.value, SchedulePolicy.CRITICAL_PATH.value]
    results = spawn_gloo(_ranks, 4, ["shm", "dist"], kinds, policies, (2, 3), torch.bfloat16,
                         timeout=120)
    assert [f for r in results for f in r["failures"]] == []
    assert all(r["digests"] == results[0]["digests"] for r in results)
    assert _no_segments() == before


def _subgroups(rank: int, world: int) -> dict:
    """Two EP groups of 2 inside a world of 4, each its own layer and session."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, sub_rank = groups[rank // 2], rank % 2
    config = RuntimeConfig(transport=TransportKind.SHM, deadline_s=20.0)
    with Session(config, group) as session:
        def runner_of(weights, policy):
            return ForwardRunner(session, weights, ForwardOptions(tiles=TILES, policy=policy,
                                                                  hardware=cpu_nominal(1, 2)))
        failures, _ = _check(runner_of, [RoutingKind.ZIPF], [SchedulePolicy.HYPERPARALLEL],
                             torch.float32, group, sub_rank, 2)
    return {"failures": failures}


def test_an_ep_group_need_not_be_the_world() -> None:
    results = spawn_gloo(_subgroups, 4, timeout=120)
    assert [f for r in results for f in r["failures"]] == []

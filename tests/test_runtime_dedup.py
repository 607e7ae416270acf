"""The deduplicated forward (per-rank and per-node dispatch) on real gloo ranks: the
routing is exchanged so that receivers expand rows; outputs and received rows bitwise
equal to the exact single-process executor, nothing left in /dev/shm."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import torch

from hpmoe.exec.exact import execute_forward
from hpmoe.routing import Routing, RoutingKind
from hpmoe.runtime import ForwardOptions, ForwardRunner, RuntimeConfig, Session, TransportKind
from hpmoe.schedule import SchedulePolicy
from hpmoe.spec import DispatchMode
from hpmoe.testing import spawn_gloo

from .handmade import UNIT_HW
from .test_runtime_forward import TILES, TOKENS, _inputs, _no_segments

TWO_TIER = replace(UNIT_HW, inter_link_bw=2.5e8, inter_latency=2e-6)  # a slower second tier
MODES = {"per-rank": replace(TILES, dispatch=DispatchMode.PER_RANK, partial_dtype=torch.bfloat16),
         "per-node": replace(TILES, dispatch=DispatchMode.PER_NODE)}


def _run(session, rank, world, nodes, kind, seed, dtype) -> tuple[list[str], list[str]]:
    """Every mode and policy on one routing: (failures, schedule digests)."""
    failures, digests = [], []
    x, routing, weights = _inputs(kind, world, dtype, seed)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    local = Routing(routing.ids[mine], routing.weights[mine])
    for name, tiles in MODES.items():
        exact = execute_forward(x, weights, routing, world, tiles, nodes=nodes).buffers[rank]
        for policy in (SchedulePolicy.HYPERPARALLEL, SchedulePolicy.CRITICAL_PATH):
            options = ForwardOptions(tiles=tiles, policy=policy, hardware=TWO_TIER, nodes=nodes)
            out = ForwardRunner(session, weights, options)(x[mine], local)
            what = f"rank {rank} {name}/{policy.value}/{kind.value}"
            failures += [f"{what}: {field} differs from the exact executor"
                         for field in ("out", "drecv", "pcomb", "hrecv")
                         if not torch.equal(getattr(out.buffers, field), getattr(exact, field))]
            s = out.schedule
            digests.append(hashlib.sha256(s.queue_task.tobytes() + s.worker.tobytes()).hexdigest())
    return failures, digests


def _ranks(rank: int, world: int, transports: list[str], nodes: int, dtype: torch.dtype) -> dict:
    failures, digests = [], []
    for transport in map(TransportKind, transports):
        with Session(RuntimeConfig(transport=transport, deadline_s=20.0)) as session:
            for seed, kind in enumerate([RoutingKind.ZIPF, RoutingKind.EMPTY_RANK, RoutingKind.GROUPED]):
                f, d = _run(session, rank, world, nodes, kind, seed, dtype)
                failures += [f"{transport.value}: {line}" for line in f]
                digests += d
    return {"failures": failures, "digests": digests}


def test_two_ranks_on_two_nodes_both_transports_are_exact() -> None:
    before = _no_segments()
    results = spawn_gloo(_ranks, 2, ["shm", "dist"], 2, torch.float32, timeout=120)
    assert [f for r in results for f in r["failures"]] == []
    assert results[0]["digests"] == results[1]["digests"]
    assert _no_segments() == before


def test_four_ranks_on_two_nodes_bf16_shm_are_exact() -> None:
    before = _no_segments()
    results = spawn_gloo(_ranks, 4, ["shm"], 2, torch.bfloat16, timeout=120)
    assert [f for r in results for f in r["failures"]] == []
    assert all(r["digests"] == results[0]["digests"] for r in results)
    assert _no_segments() == before

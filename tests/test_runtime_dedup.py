"""The deduplicated forward (per-rank and per-node dispatch) and its backward on real
gloo ranks: the routing is exchanged so that receivers expand rows; outputs, received
rows and every gradient bitwise equal to the exact single-process executors, nothing
left in /dev/shm."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import torch

from hpmoe.exec.exact import execute_forward
from hpmoe.exec.exact_backward import moe_forward_backward
from hpmoe.regions.backward_kernels import SavedActivations
from hpmoe.regions.base import Kept
from hpmoe.regions.dedup_backward_kernels import DedupBackwardBuffers
from hpmoe.routing import Routing, RoutingKind
from hpmoe.runtime import ForwardOptions, ForwardRunner, RuntimeConfig, Session, TransportKind, run_backward
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


# ---------------------------------------------------------------------------- backward


def _backward(session, rank, world, nodes, kind, seed, dtype) -> list[str]:
    """Forward then backward of every mode, policy and recompute on one routing: failures."""
    failures, SYMMETRIC = [], DedupBackwardBuffers.SYMMETRIC
    x, routing, weights = _inputs(kind, world, dtype, seed)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + seed)).to(dtype)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    experts = slice(rank * weights.spec.experts // world, (rank + 1) * weights.spec.experts // world)
    local = Routing(routing.ids[mine], routing.weights[mine])
    for (name, tiles), recompute in zip(MODES.items(), (Kept.ROWS, Kept.INPUT), strict=True):
        exact = moe_forward_backward(x, weights, routing, dy, world, tiles, recompute, nodes=nodes).backward
        want = exact.buffers[rank]
        for policy in (SchedulePolicy.HYPERPARALLEL, SchedulePolicy.CRITICAL_PATH):
            options = ForwardOptions(tiles=tiles, policy=policy, hardware=TWO_TIER, nodes=nodes)
            fwd = ForwardRunner(session, weights, options)(x[mine], local)
            saved = SavedActivations.from_forward(fwd.buffers, recompute)
            got = run_backward(session, fwd.plan, saved, dy[mine], weights, fwd.routing, options, recompute)
            g, e = got.grads, exact.grads
            pairs = {"dx": (g.dx, e.dx[mine]), "dweights": (g.dweights, e.dweights[mine]),
                     "dw13": (g.dw13[experts], e.dw13[experts]), "dw2": (g.dw2[experts], e.dw2[experts]),
                     "dsw13": (g.dshared_w13, want.dsw13), "dsw2": (g.dshared_w2, want.dsw2),
                     **{f: (getattr(got.buffers, f), getattr(want, f)) for f in SYMMETRIC}}
            what = f"rank {rank} {name}/{policy.value}/{kind.value}/recompute={recompute}"
            failures += [f"{what}: {field} differs from the exact executor"
                         for field, (a, b) in pairs.items() if not torch.equal(a, b)]
            if g.dw13.abs().sum() != g.dw13[experts].abs().sum():
                failures.append(f"{what}: dw13 is not zero off this rank's experts")
    return failures


def _backward_ranks(rank: int, world: int, transports: list[str], nodes: int,
                    dtype: torch.dtype) -> list[str]:
    failures = []
    for transport in map(TransportKind, transports):
        with Session(RuntimeConfig(transport=transport, deadline_s=20.0)) as session:
            for seed, kind in enumerate([RoutingKind.ZIPF, RoutingKind.EMPTY_RANK, RoutingKind.GROUPED]):
                failures += [f"{transport.value}: {line}"
                             for line in _backward(session, rank, world, nodes, kind, seed, dtype)]
    return failures


def test_backward_on_two_ranks_on_two_nodes_both_transports_is_exact() -> None:
    before = _no_segments()
    results = spawn_gloo(_backward_ranks, 2, ["shm", "dist"], 2, torch.float32, timeout=120)
    assert [f for r in results for f in r] == []
    assert _no_segments() == before


def test_backward_on_four_ranks_on_two_nodes_bf16_both_transports_is_exact() -> None:
    before = _no_segments()
    results = spawn_gloo(_backward_ranks, 4, ["shm", "dist"], 2, torch.bfloat16, timeout=180)
    assert [f for r in results for f in r] == []
    assert _no_segments() == before

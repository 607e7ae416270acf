"""Interleavings of a scheduled region as the persistent kernel may run it (random start
delays and speeds per queue, one task per queue per step), executed by the exact
executor on NaN-poisoned buffers: the packed waits give the reference's bits under every
interleaving, and removing any single wait that the queue order does not already imply
is caught (the output changes)."""

import dataclasses

import numpy as np
import pytest
import torch

from hpmoe.exec.exact import execute_forward, prepare_forward
from hpmoe.exec.interleave import Interleaving, device_order, drop_wait, implied_waits, interleaved_forward
from hpmoe.ir.analysis import GraphError
from hpmoe.ir.schedule import WorkerCounts
from hpmoe.routing import RoutingKind, synthetic_routing
from hpmoe.schedule import QUEUE_POLICIES, schedule
from hpmoe.sim.presets import hardware_preset
from hpmoe.spec import GateKind, MoESpec, ParallelSpec, TileSpec
from hpmoe.weights import ExpertWeights

SPEC = MoESpec(hidden=32, ffn=16, experts=4, top_k=2, shared_experts=1, gate=GateKind.SOFTMAX,
               dtype=torch.float32)
TILES = TileSpec(rows=8, gemm_rows=8, gemm_cols=16)
EP, TOKENS = 2, 16
SEEDS = 128


@pytest.fixture(scope="module")
def case():
    w = ExpertWeights.random(SPEC, 0)
    x = torch.randn(EP * TOKENS, SPEC.hidden, generator=torch.Generator().manual_seed(1))
    routing = synthetic_routing(RoutingKind.ZIPF, SPEC, ParallelSpec(EP, TOKENS), 0)
    return x, w, routing, execute_forward(x, w, routing, EP, TILES).out


WORKERS = WorkerCounts(matrix=2, vector=2)


def _schedule(graph, policy, workers=WORKERS):
    hw = dataclasses.replace(hardware_preset("h100"), matrix_workers=workers.matrix,
                             vector_workers=workers.vector)
    return schedule(graph, policy, hw)


@pytest.mark.parametrize("policy", QUEUE_POLICIES, ids=lambda p: p.name)
def test_every_interleaving_of_the_packed_waits_gives_the_references_bits(case, policy):
    x, w, routing, want = case
    for seed in range(8):
        got = interleaved_forward(x, w, routing, EP, TILES, Interleaving(policy=policy, seed=seed))
        assert torch.equal(got, want), seed


@pytest.mark.parametrize("policy", QUEUE_POLICIES, ids=lambda p: p.name)
def test_removing_any_needed_wait_is_caught(case, policy):
    x, w, routing, want = case
    graph = prepare_forward(x, w, routing, EP, TILES).graph
    needed = (graph.wait >= 0) & ~implied_waits(_schedule(graph, policy), graph)
    assert needed.sum() >= 40  # most waits are needed (a test that checks none would pass)
    missed = []
    for t in np.flatnonzero(needed).tolist():
        how = (Interleaving(policy=policy, seed=s, dropped=t) for s in range(SEEDS))
        if all(torch.equal(interleaved_forward(x, w, routing, EP, TILES, h), want) for h in how):
            missed.append(graph.task(t))
    assert missed == []


def test_the_interleavings_skew_the_queues(case):
    """Orders differ from seed to seed and from the schedule's own round-robin."""
    x, w, routing, _ = case
    graph = prepare_forward(x, w, routing, EP, TILES).graph
    sched = _schedule(graph, QUEUE_POLICIES[0])
    orders = {tuple(device_order(sched, graph, np.random.default_rng(s))) for s in range(6)}
    assert len(orders) == 6 and all(sorted(o) == list(range(graph.num_tasks)) for o in orders)


def test_a_wait_that_can_never_be_met_is_a_deadlock_not_a_hang(case):
    x, w, routing, _ = case
    graph = prepare_forward(x, w, routing, EP, TILES).graph
    sched = _schedule(graph, QUEUE_POLICIES[0])
    t = int(np.flatnonzero(graph.wait >= 0)[0])
    stuck = dataclasses.replace(graph, threshold=graph.threshold + 1000)
    with pytest.raises(GraphError, match="no queue can advance"):
        device_order(sched, stuck, np.random.default_rng(0))
    assert drop_wait(graph, t).wait[t] == -1 and graph.wait[t] >= 0

"""The per-shape forward plan (``regions.slots``): one graph and one schedule serve every
routing of a shape.  The exact executor runs it for 20 routings (balanced, zipf, one hot
expert, experts with no rows, every token on the same experts, every slot filled) and
gives the per-routing plan's bits each time; random device interleavings over
NaN-poisoned buffers give the same bits; removing any wait the rest does not imply is
caught by some routing."""

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from hpmoe.exec.exact import execute_forward, prepare_slot_forward, resolved_graph
from hpmoe.exec.interleave import Interleaving, implied_waits, interleaved_slot_forward, interleaving_schedule
from hpmoe.ir.verify import verify_graph
from hpmoe.refs import dense_moe
from hpmoe.regions.slot_routing import resolve_slots
from hpmoe.regions.slots import SlotEvent, SlotShape, plan_slots, slot_count
from hpmoe.routing import plan_routing
from hpmoe.schedule import QUEUE_POLICIES, SchedulePolicy, verify_schedule
from hpmoe.spec import DispatchMode, GateKind, MoESpec, ParallelSpec, TileSpec
from hpmoe.weights import ExpertWeights

from .slot_routings import from_counts, twenty_routings

SPEC = MoESpec(hidden=32, ffn=16, experts=4, top_k=2, shared_experts=1, gate=GateKind.SOFTMAX,
               dtype=torch.float32)
TILES = TileSpec(rows=8, gemm_rows=8, gemm_cols=16)
TOKENS = 16
SHAPE = SlotShape(SPEC, TOKENS, TILES)
FULL = [[9, 9, 9, 5], [1, 9, 9, 13]]  # every expert 1 + a multiple of G rows: all 7 slots used
SKEWED = [[16, 16, 0, 0], [16, 8, 8, 0], [16, 1, 1, 14]]
SEEDS = 48


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def case():
    w = ExpertWeights.random(SPEC, 0)
    x = torch.randn(TOKENS, SPEC.hidden, generator=torch.Generator().manual_seed(1))
    routings = twenty_routings(SPEC, TOKENS, FULL, SKEWED)
    wants = [execute_forward(x, w, r, 1, TILES).out for r in routings]
    return x, w, routings, wants, plan_slots(SHAPE)


def test_slot_count_holds_every_split_and_is_reached():
    for rows, experts, block in itertools.product((1, 5, 32, 100), (1, 4, 9), (1, 3, 8)):
        cap = slot_count(rows, experts, block)
        assert cap <= experts + rows / block
        rng = np.random.default_rng(rows * experts * block)
        for _ in range(50):
            counts = np.bincount(rng.integers(0, experts, rows), minlength=experts)
            assert (-(-counts // block)).sum() <= cap
    assert SHAPE.slots == 7
    for counts in FULL:
        assert (-(-np.array(counts) // TILES.gemm_rows)).sum() == SHAPE.slots


def test_the_shape_names_what_it_cannot_plan():
    with pytest.raises(ValueError, match="ep=2"):
        SlotShape(SPEC, TOKENS, TILES, ep=2)
    with pytest.raises(ValueError, match="multiple of rows"):
        SlotShape(SPEC, TOKENS, TileSpec(rows=3, gemm_rows=8))
    with pytest.raises(ValueError, match="PER_EXPERT"):
        SlotShape(SPEC, TOKENS, dataclasses.replace(TILES, dispatch=DispatchMode.PER_RANK))
    with pytest.raises(ValueError, match="tokens"):
        SlotShape(SPEC, 0, TILES)


def test_the_plan_is_a_valid_graph_with_static_thresholds(case):
    *_, plan = case
    g = plan.graph
    verify_graph(g)
    ev = g.events
    assert ev.offset[0, SlotEvent.OUT + 1] - ev.offset[0, SlotEvent.OUT] == 1
    # every COMBINE and shared output tile signals OUT; every UNPERMUTE waits on it
    out = int(ev.base(0, SlotEvent.OUT))
    assert g.threshold[out] == int((g.signals_global() == out).sum())
    for policy in QUEUE_POLICIES:
        verify_schedule(interleaving_schedule(g, Interleaving(policy=policy)))


def test_resolution_matches_the_routing_plan(case):
    """Each expert's rows sit in token order from its first slot (``plan_routing``'s
    order, cut at the same G-row boundaries); live rows add up to the routing's rows."""
    _, _, routings, _, _ = case
    g = TILES.gemm_rows
    for r in routings:
        slots = resolve_slots(r.ids, SHAPE)
        plan = plan_routing(r.ids, SPEC, ParallelSpec(1, TOKENS))
        counts = plan.counts[0, 0]
        assert torch.equal(slots.counts, counts)
        assert int(slots.slot_rows.sum()) == TOKENS * SPEC.top_k
        first = torch.cumsum((counts + g - 1) // g, 0) - (counts + g - 1) // g
        expert = torch.repeat_interleave(torch.arange(SPEC.experts), counts)
        rank = torch.arange(TOKENS * SPEC.top_k) - plan.send_offsets[0, :-1][expert]
        padded = first[expert] * g + rank  # slot row of each of plan_routing's permuted rows
        assert torch.equal(slots.pos.view(-1)[plan.order[0]], padded)
        assert torch.equal(slots.row_token[padded], plan.order[0] // SPEC.top_k)
        live = slots.slot_rows > 0
        per_expert = torch.bincount(slots.slot_expert[live], slots.slot_rows[live], SPEC.experts)
        assert torch.equal(per_expert.long(), counts)


def test_one_plan_serves_twenty_routings_with_the_per_routing_bits(case):
    x, w, routings, wants, plan = case
    assert len({tuple(r.ids.reshape(-1).tolist()) for r in routings}) == 20
    for r, want in zip(routings, wants, strict=True):
        got = prepare_slot_forward(plan, x, w, r).run().out
        assert torch.equal(got, want)
        torch.testing.assert_close(got, dense_moe(x, w, r), atol=1e-5, rtol=1e-5)


def test_a_routing_changes_only_the_slot_tasks_rows_and_experts(case):
    x, w, routings, _, plan = case
    g = plan.graph
    for r in routings[:3] + routings[15:]:
        got = resolved_graph(plan, resolve_slots(r.ids, SHAPE))
        for f in dataclasses.fields(g):
            if f.name not in ("row1", "expert", "events"):
                assert np.array_equal(getattr(got, f.name), getattr(g, f.name)), f.name
        assert (got.row1 <= g.row1).all() and (got.row1 >= got.row0).all()


def test_a_routing_too_big_for_the_plan_is_refused(case):
    x, w, _, _, plan = case
    more = from_counts([16, 16, 16, 16], 32, 2, 0)
    with pytest.raises(ValueError, match="16 tokens"):
        prepare_slot_forward(plan, torch.zeros(32, SPEC.hidden), w, more)


@pytest.mark.parametrize("policy", QUEUE_POLICIES, ids=lambda p: p.name)
def test_every_interleaving_of_one_schedule_gives_every_routings_bits(case, policy):
    x, w, routings, wants, plan = case
    sched = interleaving_schedule(plan.graph, Interleaving(policy=policy))
    for i, (r, want) in enumerate(zip(routings, wants, strict=True)):
        for seed in range(3):
            how = Interleaving(policy=policy, seed=100 * i + seed)
            assert torch.equal(interleaved_slot_forward(plan, sched, x, w, r, how), want), (i, seed)


@pytest.mark.parametrize("policy", [SchedulePolicy.HYPERPARALLEL], ids=lambda p: p.name)
def test_removing_any_needed_wait_is_caught_by_some_routing(case, policy):
    """The routings that fill every slot come first: a wait of the last slots' tasks
    matters only where a routing uses them.  One policy (the default): the waits are the
    graph's, and the interleavings above run every policy."""
    x, w, routings, wants, plan = case
    g = plan.graph
    sched = interleaving_schedule(g, Interleaving(policy=policy))
    needed = (g.wait >= 0) & ~implied_waits(sched, g)
    assert needed.sum() >= 40  # most waits are needed (a test that checks none would pass)
    order = [15, 17, 5, 9]  # every slot filled, skewed, zipf, one hot expert
    missed = []
    for t in np.flatnonzero(needed).tolist():
        if not any(not torch.equal(interleaved_slot_forward(plan, sched, x, w, routings[i],
                                                            Interleaving(policy=policy, seed=s, dropped=t)),
                                   wants[i])
                   for s in range(SEEDS) for i in order):
            missed.append(g.task(t))
    assert missed == []

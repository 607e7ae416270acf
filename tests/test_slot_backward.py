"""The per-shape backward plan (``regions.slot_backward``): one graph and one schedule
serve every routing of a shape.  The exact executor runs it after the per-shape forward
for 20 routings and gives the per-routing backward's bits for every gradient (input,
routing weights, expert and shared weights; experts without rows get zeros); random
device interleavings over NaN-poisoned buffers give the same bits; removing any wait the
rest does not imply is caught by some routing."""

import numpy as np
import pytest
import torch

from hpmoe.exec.exact import prepare_slot_forward, resolved_graph
from hpmoe.exec.exact_backward import moe_forward_backward, prepare_slot_backward
from hpmoe.exec.interleave import (
    Interleaving,
    implied_waits,
    interleaved_slot_backward,
    interleaving_schedule,
)
from hpmoe.ir.verify import verify_graph
from hpmoe.regions.slot_backward import SlotBackwardEvent, plan_slot_backward
from hpmoe.regions.slot_routing import resolve_slots
from hpmoe.regions.slots import plan_slots
from hpmoe.schedule import QUEUE_POLICIES, SchedulePolicy, verify_schedule
from hpmoe.weights import ExpertWeights

from .slot_routings import twenty_routings
from .test_slots import FULL, SHAPE, SKEWED, SPEC, TILES, TOKENS

GRADS = ("dx", "dweights", "dw13", "dw2", "dshared_w13", "dshared_w2")
SEEDS = 48


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def case():
    w = ExpertWeights.random(SPEC, 0)
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(TOKENS, SPEC.hidden, generator=g), torch.randn(TOKENS, SPEC.hidden, generator=g)
    routings = twenty_routings(SPEC, TOKENS, FULL, SKEWED)
    wants = [moe_forward_backward(x, w, r, dy, 1, TILES).backward.grads for r in routings]
    return x, dy, w, routings, wants, plan_slots(SHAPE), plan_slot_backward(SHAPE)


def _equal(got, want) -> list[str]:
    return [n for n in GRADS if not torch.equal(getattr(got, n), getattr(want, n))]


def test_the_plan_is_a_valid_graph_with_static_thresholds(case):
    *_, backward = case
    g = backward.graph
    verify_graph(g)
    for cat in (SlotBackwardEvent.DHALL, SlotBackwardEvent.GOUT):
        ev = int(g.events.base(0, cat))
        assert g.threshold[ev] == int((g.signals_global() == ev).sum()), cat
    assert len(backward.expert_tasks.task) == SPEC.experts * 2 * 2  # 2 column tiles each of dw2, dw13
    for policy in QUEUE_POLICIES:
        verify_schedule(interleaving_schedule(g, Interleaving(policy=policy)))


def test_one_plan_serves_twenty_routings_with_the_per_routing_gradients(case):
    x, dy, w, routings, wants, forward, backward = case
    for i, (r, want) in enumerate(zip(routings, wants, strict=True)):
        fwd = prepare_slot_forward(forward, x, w, r)
        fwd.run()
        got = prepare_slot_backward(backward, fwd.buffers[0], resolve_slots(r.ids, SHAPE), dy, w, r).run()
        assert _equal(got, want) == [], i
    assert (wants[13].dw13[1::2] == 0).all()  # experts with no rows: zero gradients, here as there


def test_an_expert_task_spans_its_experts_rows(case):
    *_, routings, _, _, backward = case
    for r in (routings[0], routings[16], routings[17]):
        slots = resolve_slots(r.ids, SHAPE)
        g = resolved_graph(backward, slots)
        et = backward.expert_tasks
        assert np.array_equal(g.row1[et.task] - g.row0[et.task], slots.counts.numpy()[et.expert])
        assert (g.row0[et.task] % TILES.gemm_rows == 0).all()


@pytest.mark.parametrize("policy", QUEUE_POLICIES, ids=lambda p: p.name)
def test_every_interleaving_of_one_schedule_gives_every_routings_gradients(case, policy):
    x, dy, w, routings, wants, forward, backward = case
    sched = interleaving_schedule(backward.graph, Interleaving(policy=policy))
    for i, (r, want) in enumerate(zip(routings, wants, strict=True)):
        for seed in range(2):
            how = Interleaving(policy=policy, seed=100 * i + seed)
            got = interleaved_slot_backward(forward, backward, sched, x, w, r, dy, how)
            assert _equal(got, want) == [], i


@pytest.mark.parametrize("policy", [SchedulePolicy.HYPERPARALLEL], ids=lambda p: p.name)
def test_removing_any_needed_wait_is_caught_by_some_routing(case, policy):
    """Under the default policy (the forward's test covers every queue policy; the
    waits are the graph's, whatever the schedule)."""
    x, dy, w, routings, wants, forward, backward = case
    g = backward.graph
    sched = interleaving_schedule(g, Interleaving(policy=policy))
    needed = (g.wait >= 0) & ~implied_waits(sched, g)
    assert needed.sum() >= 40
    order = [15, 17, 5, 9]  # every slot filled, skewed, zipf, one hot expert
    missed = []
    for t in np.flatnonzero(needed).tolist():
        if not any(_equal(interleaved_slot_backward(forward, backward, sched, x, w, routings[i], dy,
                                                    Interleaving(policy=policy, seed=s, dropped=t)), wants[i])
                   for s in range(SEEDS) for i in order):
            missed.append(g.task(t))
    assert missed == []


def test_replicated_experts_reading_rows_in_place_get_the_per_routing_gradients(case):
    """Experts 0 and 2 read the same stored row (``ExpertWeights.slot_rows``): the
    replica's gradient lands in a scratch row folded in afterwards, as per routing."""
    x, dy, w, routings, _, forward, backward = case
    placed = ExpertWeights.routed(SPEC, w.w13[:3].clone(), w.w2[:3].clone(), w.shared_w13, w.shared_w2,
                                  slot_rows=(0, 1, 0, 2))
    for r in (routings[16], routings[4]):
        want = moe_forward_backward(x, placed, r, dy, 1, TILES)
        fwd = prepare_slot_forward(forward, x, placed, r)
        assert torch.equal(fwd.run().out, want.out)
        slots = resolve_slots(r.ids, SHAPE)
        got = prepare_slot_backward(backward, fwd.buffers[0], slots, dy, placed, r).run()
        assert _equal(got, want.backward.grads) == []

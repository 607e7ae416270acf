"""Schedulers and schedule verification: exact timelines on hand-built graphs, the serial
phase chain, deadlock detection, and properties over random small configurations."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hpmoe.ir.analysis import GraphError
from hpmoe.ir.graph import IS_PUT, TaskKind
from hpmoe.regions.forward import lower_forward
from hpmoe.routing import RoutingKind
from hpmoe.schedule import (
    QUEUE_POLICIES,
    SchedulePolicy,
    critical_path_candidates,
    paper_tiles,
    schedule,
    serial_schedule,
    verify_schedule,
)
from hpmoe.schedule import critical_path as cp_module
from hpmoe.schedule.serial import phase_order
from hpmoe.sim.cost import task_costs
from hpmoe.sim.hardware import LinkEntry
from hpmoe.sim.presets import hardware_preset
from hpmoe.sim.resources import MemorySystem
from hpmoe.sim.simulate import makespan, replay, simulate
from hpmoe.spec import MoESpec, TileSpec, preset

from .handmade import UNIT_HW, US, build, by_hand, gemm, put, vec
from .helpers import tiny_plan

POLICIES = list(QUEUE_POLICIES)


def run(graph, policy, hw=UNIT_HW):
    """Schedule, verify and simulate; the timeline in rounded µs and the result."""
    s = schedule(graph, policy, hw)
    verify_schedule(s)
    r = simulate(s, hw)
    return [(round(a / US, 6), round(b / US, 6)) for a, b in zip(r.timeline.start, r.timeline.end,
                                                                strict=True)], r


def permute_then_gemm():
    """Two permutes (3 µs, 1 µs); the GEMM needs only the short one."""
    return build(1, [vec(3, kind=TaskKind.PERMUTE, signals=[(0, 0)]),
                     vec(1, kind=TaskKind.PERMUTE, signals=[(0, 1)]), gemm(2, wait=1)], {0: [1, 1]})


def exchange():
    """Two ranks permute, put to each other (1 µs and 3 µs on the link), then GEMM (2 and 4 µs)."""
    return build(2, [vec(1, kind=TaskKind.PERMUTE, rank=0, signals=[(0, 0)]),
                     vec(1, kind=TaskKind.PERMUTE, rank=1, signals=[(1, 0)]),
                     put(0, 1, 1, wait=0, signals=[(1, 1)]), put(1, 0, 3, wait=0, signals=[(0, 1)]),
                     gemm(2, rank=0, wait=1), gemm(4, rank=1, wait=1)], {0: [1, 1], 1: [1, 1]})


def test_serial_barrier_holds_the_next_phase():
    assert run(permute_then_gemm(), SchedulePolicy.SERIAL)[0] == [(0, 3), (0, 1), (3, 5)]


@pytest.mark.parametrize("policy", [SchedulePolicy.HYPERPARALLEL, SchedulePolicy.CRITICAL_PATH])
def test_overlapping_policies_start_the_gemm_early(policy):
    assert run(permute_then_gemm(), policy)[0] == [(0, 3), (0, 1), (1, 3)]


def test_serial_all_to_all_waits_for_arrivals_and_own_puts():
    # rank 0's put lands at 3, rank 1's at 5: both ranks leave the dispatch phase at 5
    timeline, r = run(exchange(), SchedulePolicy.SERIAL)
    assert timeline == [(0, 1), (0, 1), (1, 3), (1, 5), (5, 7), (5, 9)]
    assert r.makespan == pytest.approx(9 * US)


@pytest.mark.parametrize("policy", [SchedulePolicy.HYPERPARALLEL, SchedulePolicy.CRITICAL_PATH])
def test_overlapping_policies_start_each_gemm_when_its_rows_land(policy):
    timeline, _ = run(exchange(), policy)
    assert timeline == [(0, 1), (0, 1), (1, 3), (1, 5), (5, 7), (3, 7)]


def test_critical_path_runs_the_longer_chain_first():
    # one matrix worker, two ready GEMMs: task 0 (3 µs, nothing after) and task 1 (2 µs,
    # then a 5 µs vector task); id order gives 10 µs, bottom levels give 7 µs
    g = build(1, [gemm(3), gemm(2, signals=[(0, 0)]), vec(5, wait=0)], {0: [1]})
    assert run(g, SchedulePolicy.HYPERPARALLEL)[0] == [(0, 3), (3, 5), (5, 10)]
    timeline, r = run(g, SchedulePolicy.CRITICAL_PATH)
    assert timeline == [(2, 5), (0, 2), (2, 7)]
    assert r.makespan == pytest.approx(r.bounds.lower_bound)


def test_hyperparallel_deals_round_robin_and_staggers_puts():
    # rank 1 sends to 0, 2, 3: it must visit 2, 3, 0 (its peers in order (1 + i) mod 4);
    # the two other vector tasks (stagger 0) come first; all dealt 0, 1, 0, 1, 0
    tasks = [put(1, 0, 1), put(1, 2, 1), put(1, 3, 1), vec(1, rank=1), vec(1, rank=1)]
    s = schedule(build(4, tasks, {}), SchedulePolicy.HYPERPARALLEL, UNIT_HW)
    verify_schedule(s)
    assert list(s.queue_of(1, s.graph.unit[0], 0)) == [3, 1, 0]
    assert list(s.queue_of(1, s.graph.unit[0], 1)) == [4, 2]


def test_critical_path_keeps_the_fastest_candidate(monkeypatch):
    g = lower_forward(tiny_plan(RoutingKind.BALANCED, ep=2, tokens=16), TileSpec(4, 4, 8))
    hw = hardware_preset("ascend-a3")
    def worse(graph, costs, workers, order, memory=None):
        s = serial_schedule(graph, workers)
        return s, makespan(s, costs, memory)

    monkeypatch.setattr(cp_module, "list_plan", worse)
    cands = {c.name: c.makespan for c in critical_path_candidates(g, hw)}
    assert cands["list-stages"] == cands["list-priority"] == cands["serial"] > cands["hyperparallel"]
    s = schedule(g, SchedulePolicy.CRITICAL_PATH, hw)
    assert s.policy is SchedulePolicy.CRITICAL_PATH and s.candidate == "hyperparallel"
    assert simulate(s, hw).makespan == pytest.approx(cands["hyperparallel"])


@pytest.mark.parametrize("hw_name", ["ascend-a3", "h100"])
@pytest.mark.parametrize("order", list(cp_module.PutOrder))
def test_replay_reproduces_the_list_schedule(order, hw_name):
    """The list scheduler is greedy and starts the tasks of an instant in the order the
    replay of its queues does, so that replay gives back its own timeline, with memory
    (L2 and shared HBM) or without."""
    g = lower_forward(tiny_plan(RoutingKind.ZIPF, ep=4, tokens=24), TileSpec(4, 4, 8))
    hw = hardware_preset(hw_name)
    workers, costs = hw.workers, task_costs(g, hw)
    puts = cp_module.put_order(g, costs, workers, order)
    prio = cp_module.priority_rank(g, costs, workers, order, puts)
    by_prio = order in (cp_module.PutOrder.PRIORITY, cp_module.PutOrder.EXPERT)
    for memory in (None, MemorySystem.of(g, hw)):
        state = cp_module._ListReplay(g, costs, workers, prio, prio if by_prio else puts, memory)
        state.loop()
        s, span = cp_module.list_plan(g, costs, workers, order, memory)
        verify_schedule(s)
        end = replay(s, costs, memory)[1]
        assert np.array_equal(end, np.asarray(state.end)) and span == end.max()


def test_the_list_starts_an_instant_s_tasks_as_the_queue_replay_does():
    """Two GEMMs read the same operands (the second to start hits the L2): the urgent one
    (X, a long chain after it) becomes ready at the same instant as the other (Y), whose
    event fires first.  The replay of the queues starts Y first (its worker wakes first),
    so the list must too, or its timeline is not the replay's."""
    hw = dataclasses.replace(UNIT_HW, matrix_workers=2, mem_bw=1e12, l2_mb=64.0)
    g = build(1, [vec(1, signals=[(0, 0)]), vec(1, signals=[(0, 1)]),
                  gemm(2, wait=1, signals=[(0, 2)]), gemm(2, wait=0), vec(5, wait=2)], {0: [1, 1, 1]})
    workers, costs, memory = hw.workers, task_costs(g, hw), MemorySystem.of(g, hw)
    s = cp_module.list_schedule(g, costs, workers, cp_module.PutOrder.STAGES, memory)
    start, end = replay(s, costs, memory)[:2]
    assert start[3] == start[2] == 1 * US and end[3] > end[2]  # Y started first and missed
    state = cp_module._ListReplay(g, costs, workers, cp_module.priority_rank(g, costs, workers),
                                  cp_module.port_order(g, rounds=False), memory)
    state.loop()
    assert np.array_equal(end, np.asarray(state.end))


def test_queue_order_against_a_dependency_is_a_named_cycle():
    g = build(1, [vec(1, wait=0), vec(1, signals=[(0, 0)])], {0: [1]})
    with pytest.raises(GraphError, match="dependency cycle") as err:
        verify_schedule(by_hand(g, [0, 0]))
    message = str(err.value)
    assert "queue-order event" in message and "rank 0 vector worker 0" in message
    assert "task 0 SWIGLU" in message and "task 1 SWIGLU" in message
    verify_schedule(by_hand(g, [0, 0], order=[1, 0]))  # the other order is fine
    verify_schedule(by_hand(g, [0, 1]))  # and so are two workers


def test_cycle_across_two_queues_is_caught():
    # worker 0: [a waits e0, b signals e1]; worker 1: [c waits e1, d signals e0]
    g = build(1, [vec(1, wait=0), vec(1, signals=[(0, 1)]), vec(1, wait=1), vec(1, signals=[(0, 0)])],
              {0: [1, 1]})
    with pytest.raises(GraphError, match="dependency cycle"):
        verify_schedule(by_hand(g, [0, 0, 1, 1]))
    verify_schedule(by_hand(g, [0, 0, 1, 1], order=[1, 0, 3, 2]))


def test_unreachable_threshold_is_reported():
    g = build(1, [vec(1, signals=[(0, 0)]), vec(1, wait=0)], {0: [2]})
    with pytest.raises(GraphError, match="unreachable threshold"):
        verify_schedule(by_hand(g, [0, 1]))


def test_malformed_schedule_is_a_value_error():
    s = by_hand(permute_then_gemm(), [0, 1, 0])
    with pytest.raises(ValueError, match="permutation"):
        verify_schedule(dataclasses.replace(s, queue_task=np.array([0, 0, 2])))
    with pytest.raises(ValueError, match="worker"):
        by_hand(permute_then_gemm(), [0, 2, 0])
    with pytest.raises(TypeError, match="SchedulePolicy"):
        schedule(permute_then_gemm(), "serial", UNIT_HW)


def test_forward_phase_order():
    g = lower_forward(tiny_plan(RoutingKind.ZIPF, ep=2, tokens=16), TileSpec(4, 4, 8))
    assert phase_order(g) == (TaskKind.SHARED_UP, TaskKind.SHARED_SWIGLU, TaskKind.SHARED_DOWN,
                              TaskKind.PERMUTE, TaskKind.DISPATCH, TaskKind.GEMM_UP, TaskKind.SWIGLU,
                              TaskKind.GEMM_DOWN, TaskKind.COMBINE, TaskKind.UNPERMUTE)


@pytest.mark.parametrize("kind", [RoutingKind.EMPTY_RANK, RoutingKind.HOT, RoutingKind.BALANCED])
def test_serial_phases_never_overlap_on_a_rank(kind):
    """Every task of a phase starts after every task of earlier phases on its rank, and
    after every put of earlier phases that arrives at its rank — also when a rank has
    nothing to do in some phase (empty-rank routing)."""
    g = lower_forward(tiny_plan(kind, ep=4, tokens=12), TileSpec(4, 4, 8))
    hw = hardware_preset("ascend-a3")
    _, r = run(g, SchedulePolicy.SERIAL, hw)
    tl, kinds = r.timeline, phase_order(g)
    phase = np.array([kinds.index(TaskKind(k)) for k in g.kind])
    for rank in range(g.ep):
        for p in range(1, len(kinds)):
            later = (g.rank == rank) & (phase == p)
            done = ((g.rank == rank) | (IS_PUT[g.kind] & (g.peer == rank))) & (phase < p)
            if later.any() and done.any():
                assert tl.start[later].min() >= tl.end[done].max() - 1e-15


def test_paper_tiles():
    hw = hardware_preset("ascend-a3")
    tiles = paper_tiles(hw)
    assert tiles == TileSpec(rows=128, gemm_rows=0, gemm_splits=24)
    assert tiles.column_tile(2 * 2048) == 171 and tiles.column_tile(7168) == 299  # one tile per AIC


SMALL = MoESpec(hidden=24, ffn=8, experts=4, top_k=2, dtype=torch.float32)
SMALL_HW = dataclasses.replace(UNIT_HW, task_overhead=1e-7, mem_bw=1e10, matrix_block=4)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe=st.sampled_from([preset("tiny"), SMALL]), ep=st.sampled_from([1, 2, 4]),
       tokens=st.integers(1, 24), kind=st.sampled_from(list(RoutingKind)), seed=st.integers(0, 99),
       tiles=st.sampled_from([TileSpec(2, 0, 8), TileSpec(4, 4, 8), TileSpec(8, 8, 16)]),
       hw=st.sampled_from([hardware_preset("ascend-a3"), SMALL_HW]))
def test_every_policy_is_valid_and_above_the_bound(moe, ep, tokens, kind, seed, tiles, hw):
    assume(moe.experts % ep == 0)
    assume(kind is not RoutingKind.EMPTY_RANK or moe.experts - moe.experts // ep >= moe.top_k)
    g = lower_forward(tiny_plan(kind, ep=ep, tokens=tokens, seed=seed, moe=moe), tiles)
    spans = {}
    for policy in POLICIES:
        _, r = run(g, policy, hw)
        assert r.makespan >= r.bounds.lower_bound * (1 - 1e-9)
        spans[policy] = r.makespan
    assert spans[SchedulePolicy.CRITICAL_PATH] <= spans[SchedulePolicy.SERIAL] * (1 + 1e-12)


def test_infinitely_fast_links_leave_only_the_compute_overlap_gain():
    moe = MoESpec(hidden=1024, ffn=256, experts=16, top_k=4, shared_experts=1)  # DeepSeek-like ratios
    g = lower_forward(tiny_plan(RoutingKind.BALANCED, ep=4, tokens=512, moe=moe), TileSpec(128, 128, 256))
    real = dataclasses.replace(hardware_preset("ascend-a3"), stream_bw=0.0)  # the port is the limit
    fast = dataclasses.replace(real, link=(LinkEntry(1, 1e30, 1e30),), link_latency=0.0)
    ratio = {}
    for name, hw in (("real", real), ("fast", fast)):
        serial = run(g, SchedulePolicy.SERIAL, hw)[1]
        ours = run(g, SchedulePolicy.CRITICAL_PATH, hw)[1]
        ratio[name] = serial.makespan / ours.makespan
    bound = ours.bounds  # the fast links' bounds: puts cost their issue overhead only
    remote = IS_PUT[g.kind] & (g.link_bytes > 0)
    put_time = serial.timeline.end[remote] - serial.timeline.start[remote]
    assert np.allclose(put_time, fast.task_overhead, rtol=1e-9)
    assert bound.link <= bound.critical_path
    # what is left is overlapping matrix with vector work: at most serial over the work bound
    assert 1.0 <= ratio["fast"] <= serial.makespan / max(bound.work, bound.critical_path) + 1e-9
    assert ratio["fast"] < ratio["real"]
    assert fast.workers.vector == real.vector_workers

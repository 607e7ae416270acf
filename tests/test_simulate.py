"""Simulator: exact timelines of hand-built schedules, link ports, bounds, stalls and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpmoe.cli import main
from hpmoe.ir.analysis import GraphError
from hpmoe.ir.graph import TaskKind
from hpmoe.regions.forward import lower_forward
from hpmoe.routing import RoutingKind
from hpmoe.schedule import QUEUE_POLICIES, SchedulePolicy, schedule
from hpmoe.sim.bounds import graph_bounds
from hpmoe.sim.presets import hardware_preset
from hpmoe.sim.simulate import Timeline, simulate

from .handmade import UNIT_HW, US, build, by_hand, gemm, put, vec
from .helpers import TINY_TILES, tiny_plan


def times(timeline: Timeline) -> list[tuple[float, float]]:
    """(start, end) of every task in µs, rounded."""
    return [(round(s / US, 6), round(e / US, 6)) for s, e in zip(timeline.start, timeline.end, strict=True)]


def test_chain_of_three_runs_back_to_back():
    g = build(1, [vec(3, kind=TaskKind.PERMUTE, signals=[(0, 0)]), gemm(2, wait=0, signals=[(0, 1)]),
                  vec(4, wait=1)], {0: [1, 1]})
    r = simulate(by_hand(g, [0, 0, 1]), UNIT_HW)
    assert times(r.timeline) == [(0, 3), (3, 5), (5, 9)]
    assert r.makespan == pytest.approx(9 * US)
    assert r.bounds.critical_path == pytest.approx(9 * US)
    # the matrix worker cannot start before 3 µs and 4 µs must follow it: 3 + 2 + 4
    assert r.bounds.matrix_work == pytest.approx(9 * US)
    assert r.bounds.lower_bound == pytest.approx(r.makespan)


def test_fan_in_waits_for_the_threshold():
    g = build(1, [vec(3, signals=[(0, 0)]), vec(5, signals=[(0, 0)]), gemm(2, wait=0)], {0: [2]})
    r = simulate(by_hand(g, [0, 1, 0]), UNIT_HW)
    assert times(r.timeline) == [(0, 3), (0, 5), (5, 7)]


def test_threshold_below_signal_count_fires_at_the_kth_signal():
    g = build(1, [vec(3, signals=[(0, 0)]), vec(5, signals=[(0, 0)]), gemm(2, wait=0)], {0: [1]})
    r = simulate(by_hand(g, [0, 1, 0]), UNIT_HW)
    assert times(r.timeline)[2] == (3, 5)


def test_queue_order_forces_a_wait():
    # worker 0 runs [x, y]; x waits on the matrix task, so y (ready at 0) waits too
    g = build(1, [gemm(5, signals=[(0, 0)]), vec(1, wait=0), vec(1)], {0: [1]})
    r = simulate(by_hand(g, [0, 0, 0]), UNIT_HW)
    assert times(r.timeline) == [(0, 5), (5, 6), (6, 7)]
    r = simulate(by_hand(g, [0, 0, 0], order=[0, 2, 1]), UNIT_HW)
    assert times(r.timeline) == [(0, 5), (5, 6), (0, 1)]


def test_two_puts_share_one_egress_port():
    g = build(3, [put(0, 1, 2, signals=[(1, 0)]), put(0, 2, 2, signals=[(2, 0)])], {1: [1], 2: [1]})
    r = simulate(by_hand(g, [0, 1]), UNIT_HW)
    tl = r.timeline
    assert list(np.round(tl.link_start / US, 6)) == [0, 2]
    assert list(np.round(tl.link_end / US, 6)) == [2, 4]
    assert times(tl) == [(0, 3), (0, 5)]  # each worker is busy until its put lands (+1 µs)
    assert r.bounds.link == pytest.approx(4 * US + 1 * US)  # 4 µs on the port, then the latency


def test_two_puts_share_one_ingress_port():
    g = build(3, [put(1, 0, 2, signals=[(0, 0)]), put(2, 0, 3, signals=[(0, 0)]), gemm(1, wait=0)], {0: [2]})
    r = simulate(by_hand(g, [0, 0, 0]), UNIT_HW)
    assert list(np.round(r.timeline.link_start[:2] / US, 6)) == [0, 2]
    assert times(r.timeline) == [(0, 3), (0, 6), (6, 7)]


def test_put_to_a_busy_peer_does_not_block_puts_to_others():
    # rank 1 holds rank 2's ingress for 5 µs; rank 0 issued a put to 2 first, then one
    # to 1: the put to 1 goes at once, the put to 2 when rank 2's ingress frees
    g = build(3, [put(1, 2, 5), put(0, 2, 1), put(0, 1, 1)], {})
    r = simulate(by_hand(g, [0, 0, 1]), UNIT_HW)
    assert list(np.round(r.timeline.link_start / US, 6)) == [0, 5, 0]
    assert list(np.round(r.timeline.link_end / US, 6)) == [5, 6, 1]


def test_ingress_serves_waiting_egress_ports_first_come_first_served():
    # rank 3's ingress is busy until 4 µs; rank 1 starts waiting for it at 1 µs (after its
    # 1 µs put to 0), rank 2 at 2 µs: rank 1 goes first
    g = build(4, [put(0, 3, 4), put(1, 0, 1), put(1, 3, 1), put(2, 1, 2), put(2, 3, 1)], {})
    r = simulate(by_hand(g, [0, 0, 1, 0, 1], order=[0, 1, 3, 2, 4]), UNIT_HW)
    assert list(np.round(r.timeline.link_start / US, 6)) == [0, 0, 4, 0, 5]


def test_local_put_is_a_memory_copy_without_link():
    g = build(2, [put(0, 0, 2, signals=[(0, 0)]), gemm(1, wait=0)], {0: [1]})
    r = simulate(by_hand(g, [0, 0]), UNIT_HW)
    assert np.isnan(r.timeline.link_start[0])
    assert r.bounds.link == 0.0


def test_blocked_queue_raises_with_the_cycle():
    g = build(1, [vec(1, wait=0), vec(1, signals=[(0, 0)])], {0: [1]})
    with pytest.raises(GraphError, match="cycle"):
        simulate(by_hand(g, [0, 0]), UNIT_HW)


def test_simulation_needs_every_rank():
    g = lower_forward(tiny_plan(RoutingKind.BALANCED, ep=2), TINY_TILES, ranks=(0,))
    s = by_hand(build(1, [vec(1)], {}), [0])
    with pytest.raises(ValueError, match="ranks"):
        simulate(s.__class__(**{**s.__dict__, "graph": g}), UNIT_HW)


@pytest.mark.parametrize("policy", QUEUE_POLICIES)
def test_lowered_graph_timeline_is_consistent(policy):
    g = lower_forward(tiny_plan(RoutingKind.ZIPF, ep=4, tokens=16), TINY_TILES)
    hw = hardware_preset("ascend-a3")
    r = simulate(schedule(g, policy, hw), hw)
    tl = r.timeline
    assert (tl.end >= tl.start).all() and r.makespan >= r.bounds.lower_bound * (1 - 1e-12)
    wait = r.timeline.start  # every task starts after its event fired: after each signaller's end
    sg = g if policy is not SchedulePolicy.SERIAL else schedule(g, policy, hw).graph
    waited = sg.wait_global()
    ends = np.full(sg.num_events, -np.inf)
    np.maximum.at(ends, sg.signals_global(), tl.end[sg.signaller()])
    has = waited >= 0
    assert (wait[has] >= ends[waited[has]] - 1e-15).all()


def test_graph_bounds_match_simulated_bounds():
    g = lower_forward(tiny_plan(RoutingKind.BALANCED, ep=2, tokens=16), TINY_TILES)
    hw = hardware_preset("ascend-a3")
    assert graph_bounds(g, hw) == simulate(schedule(g, SchedulePolicy.HYPERPARALLEL, hw), hw).bounds


def test_cli_simulate_prints_one_json_object(capsys):
    assert main(["simulate", "--preset", "tiny", "--ep", "2", "--tokens", "16", "--dtype", "fp32",
                 "--routing", "zipf", "--schedule", "critical-path", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("makespan_us", "lower_bound_us", "bounds", "hbm_bytes", "l2_hit_rate", "ranks_per_token",
                "tasks", "schedule", "hardware"):
        assert key in out
    assert set(out["bounds"]) >= {"matrix_work_us", "link_us", "critical_path_us", "memory_us", "max_us"}
    assert out["makespan_us"] >= out["lower_bound_us"] * (1 - 1e-9)
    assert out["schedule"] == "critical-path" and out["hardware"] == "ascend-a3"


def test_cli_reproduce_table(capsys):
    assert main(["reproduce", "--preset", "tiny", "--tokens", "32", "--ep", "2", "4", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    rows = out["rows"]
    assert [(r["direction"], r["ep"], r["routing"], r["region"]) for r in rows] == [
        ("forward", ep, "grouped", region) for ep in (2, 4) for region in ("full", "paper")]
    assert out["paper_speedup"] == [1.49, 1.58]
    for r in rows:
        assert r["baseline"] == "serial-dedup" and r["critical_path_us"] <= r["serial_us"]
        assert r["critical_path_us"] >= r["lower_bound_us"] * (1 - 1e-6) >= r["memory_bound_us"] * (1 - 1e-6)
        assert r["paper_speedup"] == ([1.49, 1.58] if r["region"] == "paper" else None)
        assert r["critical_path_speedup"] == pytest.approx(r["baseline_us"] / r["critical_path_us"], rel=0.02)
    full, paper = rows[0], rows[1]
    assert paper["critical_path_us"] < full["critical_path_us"]  # less work in the paper's region
    assert "[2/2]" in captured.err

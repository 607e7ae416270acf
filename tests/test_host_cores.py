"""Host cores in the replay (``HardwareModel.host_cores``): the worker threads of a CPU
host's ranks time-share its cores, each hand-built case with a known answer."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hpmoe.ir.graph import TaskKind
from hpmoe.regions.kernels import FORWARD
from hpmoe.schedule import WorkerCounts
from hpmoe.schedule.auto import kernel_by_kernel_forecast
from hpmoe.sim.cost import task_costs
from hpmoe.sim.forecast import HostCosts, core_share, forecast_region, replay_on_kernels, runtime_hardware
from hpmoe.sim.presets import cpu_nominal
from hpmoe.sim.simulate import simulate

from .handmade import UNIT_HW, US, build, by_hand, gemm, put, vec
from .helpers import TINY_TILES, tiny_plan


def ends(graph, workers: list[int], hw, counts: WorkerCounts | None = None) -> list[float]:
    s = by_hand(graph, workers) if counts is None else by_hand(graph, workers, workers=counts)
    return list(np.round(simulate(s, hw).timeline.end / US, 6))


def test_without_host_cores_every_worker_has_its_own_core():
    g = build(1, [gemm(10), vec(10)], {})
    assert ends(g, [0, 0], UNIT_HW) == [10, 10]


def test_matrix_and_vector_workers_of_one_rank_share_one_core():
    """10 µs each on one core: half a core each, both end at 20 µs."""
    g = build(1, [gemm(10), vec(10)], {})
    assert ends(g, [0, 0], dataclasses.replace(UNIT_HW, host_cores=1.0)) == [20, 20]


def test_three_workers_on_two_cores_get_two_thirds_each_until_one_ends():
    """Rank 0's matrix and vector workers and rank 1's matrix worker on a 2-core host:
    2/3 of a core each until the 6 µs task ends at 9 µs, then a whole core each."""
    g = build(2, [gemm(10), vec(6), gemm(10, rank=1)], {})
    hw = dataclasses.replace(UNIT_HW, host_cores=2.0)
    assert ends(g, [0, 0, 0], hw) == [13, 9, 13]


def test_ranks_on_different_nodes_do_not_share_cores():
    g = dataclasses.replace(build(2, [gemm(10), gemm(10, rank=1)], {}), nodes=2)
    assert ends(g, [0, 0], dataclasses.replace(UNIT_HW, host_cores=1.0, inter_link_bw=1e9)) == [10, 10]


def test_on_a_core_memory_streams_at_one_cores_rate_unshared():
    """Two vector tasks of 1000 and 3000 bytes at 1 GB/s per core on 2 cores: 1 and 3 µs
    (with a shared HBM they would end at 2 and 4 µs), plus the task overhead."""
    hw = dataclasses.replace(UNIT_HW, mem_bw=1e9, host_cores=2.0, task_overhead=1 * US)
    g = build(1, [vec(0, bytes=1000.0), vec(0, bytes=3000.0)], {})
    assert ends(g, [0, 1], hw) == [2, 4]
    assert ends(g, [0, 1], dataclasses.replace(hw, host_cores=1.0)) == [4, 6]


def test_tasks_of_one_host_share_its_memory_bandwidth():
    """Two ranks of a 2-core host each stream 1000 bytes at 1 GB/s a core: 1 µs each
    alone; with the host's memory at 1 GB/s in all, both end at 2 µs (their sum over it)."""
    hw = dataclasses.replace(UNIT_HW, mem_bw=1e9, host_cores=2.0)
    g = build(2, [vec(0, bytes=1000.0), vec(0, rank=1, bytes=1000.0)], {})
    assert ends(g, [0, 0], hw) == [1, 1]
    assert ends(g, [0, 0], dataclasses.replace(hw, host_mem_bw=1e9)) == [2, 2]


def test_a_task_streams_at_most_one_cores_rate_from_the_host_memory():
    """1000 and 3000 bytes on a 2-core host whose memory serves 1.5 GB/s, a core 1 GB/s:
    0.75 GB/s each until the first ends at 4/3 µs, then the second alone at its core's
    1 GB/s (not 1.5) for its last 2000 bytes: 10/3 µs.  Alone, 3 µs: the core's rate."""
    hw = dataclasses.replace(UNIT_HW, mem_bw=1e9, host_cores=2.0, host_mem_bw=1.5e9)
    g = build(1, [vec(0, bytes=1000.0), vec(0, bytes=3000.0)], {})
    assert ends(g, [0, 1], hw) == [round(4 / 3, 6), round(10 / 3, 6)]
    assert ends(build(1, [vec(0, bytes=3000.0)], {}), [0], hw) == [3]


def test_a_task_ends_when_both_its_core_time_and_its_bytes_are_served():
    """One rank, one core, host memory 1 GB/s: a 10 µs compute task beside a 1000-byte
    stream: the core is shared (the stream needs 1 µs of it, so it ends at 2 µs, the
    compute task at 11 µs) and the bytes alone would take 1 µs: the core decides.  At
    0.25 GB/s the bytes take 4 µs: the memory decides, and frees nothing of the core."""
    hw = dataclasses.replace(UNIT_HW, mem_bw=1e9, host_cores=1.0, host_mem_bw=1e9)
    g = build(1, [vec(10), vec(0, bytes=1000.0)], {})
    assert ends(g, [0, 1], hw) == [11, 2]
    assert ends(g, [0, 1], dataclasses.replace(hw, host_mem_bw=0.25e9)) == [11, 4]


def test_forecast_is_the_replay_when_cores_are_modelled():
    g = build(1, [gemm(10), vec(10)], {})
    s = by_hand(g, [0, 0])
    shared = dataclasses.replace(UNIT_HW, host_cores=1.0)
    assert forecast_region(s, shared)[0] == pytest.approx(20 * US)


def test_forecast_replays_the_costs_it_is_given():
    """The same two tasks on one core with their work set to 4 and 6 µs (as a run's
    measured kernel times would be) instead of the model's 10 and 10: 10 µs, not 20."""
    g = build(1, [gemm(10), vec(10)], {})
    s = by_hand(g, [0, 0])
    shared = dataclasses.replace(UNIT_HW, host_cores=1.0)
    model = task_costs(g, shared)
    given = dataclasses.replace(model, work=np.array([4e-6, 6e-6]), floor=np.array([4e-6, 6e-6]))
    assert forecast_region(s, shared, costs=model)[0] == pytest.approx(20 * US)
    assert forecast_region(s, shared, costs=given)[0] == pytest.approx(10 * US)


def test_a_replay_on_measured_kernels_charges_their_cpu_plus_the_executors():
    """Kernels measured at 3 and 5 µs of CPU, 1 µs of executor CPU per task, one core:
    demands 4 + 6, the region 10 µs, whatever the model's costs (10 + 10, and 1 kB each
    from a shared 1 MB/s memory: 1 ms) say; memory is inside the measured times, so not
    shared apart."""
    g = build(1, [gemm(10, bytes=1e3), vec(10, bytes=1e3)], {})
    s = by_hand(g, [0, 0])
    hw = dataclasses.replace(UNIT_HW, host_cores=1.0, mem_bw=1e6, shared_hbm=True)
    assert forecast_region(s, hw)[0] >= 1e-3
    assert replay_on_kernels(s, hw, np.array([3e-6, 5e-6]), 1e-6) == pytest.approx(10 * US)
    with pytest.raises(ValueError, match=r"one time per task \(2\), got 1"):
        replay_on_kernels(s, hw, np.array([3e-6]), 1e-6)
    with pytest.raises(ValueError, match=r"kernel_cpu\[1\] must be >= 0 seconds, got nan"):
        replay_on_kernels(s, hw, np.array([3e-6, np.nan]), 1e-6)


def test_unpermute_traffic_scales_only_unpermute_bytes():
    g = build(1, [vec(0, kind=TaskKind.UNPERMUTE, bytes=1000.0), vec(0, bytes=1000.0)], {})
    hw = dataclasses.replace(UNIT_HW, mem_bw=1e9, host_cores=2.0, unpermute_traffic=3.0)
    assert ends(g, [0, 1], hw) == [3, 1]
    assert list(np.round(task_costs(g, hw).work / US, 6)) == [3, 1]


def test_a_puts_host_cpu_competes_for_the_core_and_gates_nothing():
    """One core; a 10 µs GEMM and a remote put of 3 µs on the link (+1 µs latency) whose
    transport burns 10 µs of host CPU: the put still ends at 4 µs, but its CPU shares the
    core with the GEMM from 0 on, so both need 20 µs of the core's time: the GEMM ends at
    20.  Without ``put_cpu`` the GEMM ends at 10."""
    g = build(2, [gemm(10), put(0, 1, 3)], {})
    hw = dataclasses.replace(UNIT_HW, host_cores=1.0, put_cpu=10e-6)
    assert ends(g, [0, 1], hw) == [20, 4]
    assert ends(g, [0, 1], dataclasses.replace(hw, put_cpu=0.0)) == [10, 4]
    local = build(2, [gemm(10), put(0, 0, 3)], {})  # a copy within the rank burns no transport CPU
    assert ends(local, [0, 1], hw)[0] == 10


def test_a_rank_entering_late_delays_its_peers_and_the_region_counts_each_from_its_entry():
    """Rank 0 puts 3 µs (+1 µs latency) to rank 1, whose 10 µs SwiGLU waits for it.  All
    entering at 0: the SwiGLU ends at 14.  Rank 0 entering at 2 µs: its put lands at 6,
    the SwiGLU ends at 16, and the region is rank 1's 16 µs in it (rank 0's: 4)."""
    g = build(2, [put(0, 1, 3, signals=[(1, 0)]), vec(10, rank=1, wait=0)], {1: [1]})
    s = by_hand(g, [0, 0])
    assert forecast_region(s, UNIT_HW)[0] == pytest.approx(14 * US)
    seconds, sim = forecast_region(s, UNIT_HW, entry=np.array([2 * US, 0.0]))
    assert seconds == pytest.approx(16 * US)
    assert list(np.round(sim.timeline.start / US, 6)) == [2, 6]
    with pytest.raises(ValueError, match="entry"):
        simulate(s, UNIT_HW, entry=np.array([0.0]))


def test_without_host_cores_a_forecast_is_floored_at_the_work_over_the_cores(monkeypatch):
    """Three workers of one rank run 10 µs each at once (makespan 10), but the rank owns
    one core: the forecast is its 30 µs of work, with an entry time as without."""
    monkeypatch.setattr("hpmoe.sim.forecast.cores_per_rank", lambda ep: 1.0)
    s = by_hand(build(1, [gemm(10), vec(10), vec(10)], {}), [0, 0, 1])
    assert simulate(s, UNIT_HW).makespan == pytest.approx(10 * US)
    assert forecast_region(s, UNIT_HW)[0] == pytest.approx(30 * US)
    assert forecast_region(s, UNIT_HW, entry=np.array([1 * US]))[0] == pytest.approx(30 * US)


def test_a_taskflow_forecast_adds_the_launch_and_the_kernel_by_kernel_path_has_none():
    """``launch_overhead`` 5 µs: a 20 µs replay is forecast at 25 µs; the kernel-by-kernel
    path (torch kernels in turn, no executor) is forecast the same with it as without."""
    s = by_hand(build(1, [gemm(10), vec(10)], {}), [0, 0])
    hw = dataclasses.replace(UNIT_HW, host_cores=1.0, launch_overhead=5e-6)
    assert forecast_region(s, hw)[0] == pytest.approx(25 * US)
    plan, cpu = tiny_plan(), cpu_nominal(1, 1)
    launched = dataclasses.replace(cpu, launch_overhead=1e-3)
    assert kernel_by_kernel_forecast(plan, launched).region_s == kernel_by_kernel_forecast(plan, cpu).region_s


def test_core_share_divides_out_ranks_beyond_the_cores():
    assert core_share(0.9, ep=2, cores=2.0) == pytest.approx(0.9)
    assert core_share(0.45, ep=4, cores=2.0) == pytest.approx(0.9)
    assert core_share(0.6, ep=4, cores=2.0) == pytest.approx(1.2)  # a host faster than at calibration


def test_runtime_hardware_divides_only_the_vector_rate_by_its_slowdown():
    """A vector slowdown of 2 under load halves the vector rate a task is charged and
    leaves the GEMM rates as the share makes them."""
    g = build(1, [gemm(10), vec(10)], {})
    plain = runtime_hardware(UNIT_HW, WorkerCounts(1, 1), None, HostCosts(1.0, 0.0), ep=1)
    slow = runtime_hardware(UNIT_HW, WorkerCounts(1, 1), None, HostCosts(1.0, 0.0, vector_slowdown=2.0), ep=1)
    assert slow.vector_flops == pytest.approx(plain.vector_flops / 2)
    assert slow.matrix_flops_bf16 == plain.matrix_flops_bf16
    gemm_s, vec_s = task_costs(g, plain).work
    assert list(task_costs(g, slow).work) == pytest.approx([gemm_s, 2 * vec_s])
    with pytest.raises(ValueError, match="HostCosts.vector_slowdown"):
        HostCosts(1.0, 0.0, vector_slowdown=0.0)


def test_a_sleeping_worker_starts_its_task_a_wake_latency_after_the_event():
    """GEMM 10 µs signals; the SwiGLU waiting for it on the other worker was there first
    (asleep), so it starts 3 µs after the event: ends 10 and 23.  A SwiGLU whose event
    had fired when its worker got there starts at once: a 12 µs SwiGLU ahead of it on
    the vector worker makes it arrive after the GEMM, and it ends at 22.  Without host
    cores (an accelerator's workers spin) there is no wake latency."""
    hw = dataclasses.replace(UNIT_HW, host_cores=2.0, wake_latency=3e-6)
    waits = build(1, [gemm(10, signals=[(0, 0)]), vec(10, wait=0)], {0: [1]})
    assert ends(waits, [0, 1], hw) == [10, 23]
    assert ends(waits, [0, 1], dataclasses.replace(hw, wake_latency=0.0)) == [10, 20]
    late = build(1, [gemm(10, signals=[(0, 0)]), vec(12), vec(10, wait=0)], {0: [1]})
    assert ends(late, [0, 1, 1], hw) == [10, 12, 22]
    assert ends(waits, [0, 1], dataclasses.replace(hw, host_cores=0.0)) == [10, 20]


def test_host_cores_must_be_finite_and_non_negative():
    with pytest.raises(ValueError, match="host_cores"):
        dataclasses.replace(UNIT_HW, host_cores=-1.0)
    with pytest.raises(ValueError, match="unpermute_traffic"):
        dataclasses.replace(UNIT_HW, unpermute_traffic=0.0)


def test_a_lowered_region_on_shared_cores_keeps_its_bounds_and_the_cores_bound():
    """The small layer on a 2-core host: the replay is never below the bounds, nor below
    the host's total core time over its cores (every task's work on some core)."""
    from hpmoe.regions.forward import lower_forward
    from hpmoe.routing import RoutingKind, plan_routing, synthetic_routing
    from hpmoe.schedule import SchedulePolicy, schedule
    from hpmoe.sim.presets import hardware_preset
    from hpmoe.spec import ParallelSpec, TileSpec, preset

    moe, par = preset("small"), ParallelSpec(ep=2, tokens_per_rank=256)
    ids = synthetic_routing(RoutingKind.GROUPED, moe, par).ids
    g = lower_forward(plan_routing(ids, moe, par), TileSpec())
    hw = dataclasses.replace(hardware_preset("ascend-a3"), matrix_workers=1, vector_workers=1, l2_mb=0.0,
                             host_cores=2.0, task_overhead=10 * US)
    for policy in (SchedulePolicy.SERIAL, SchedulePolicy.HYPERPARALLEL):
        r = simulate(schedule(g, policy, hw), hw)
        assert r.makespan >= r.bounds.lower_bound * (1 - 1e-9)
        assert r.makespan >= task_costs(g, hw).floor.sum() / 2.0 * (1 - 1e-9)


def test_the_critical_path_scheduler_ranks_candidates_on_the_shared_cores():
    """Each candidate's makespan is what ``simulate`` replays for it, host cores included."""
    from hpmoe.schedule.critical_path import critical_path_candidates

    hw = dataclasses.replace(cpu_nominal(2, 2), host_cores=2.0)  # 8 workers on 2 cores
    unshared = dataclasses.replace(hw, host_cores=0.0)
    graph = FORWARD.lower(tiny_plan(ep=2, tokens=16), TINY_TILES, None)
    for c in critical_path_candidates(graph, hw):
        assert c.makespan > simulate(c.schedule, unshared).makespan, c.name  # the cores bind here
        assert c.makespan == pytest.approx(simulate(c.schedule, hw).makespan, rel=1e-12), c.name

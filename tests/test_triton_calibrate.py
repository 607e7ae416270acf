"""Fitting a GPU hardware model to a timeline: on a timeline the simulator made from a
known model, the fit must give that model back and predict the same makespan."""

import dataclasses

import numpy as np
import pytest
import torch

from hpmoe.gpu.calibrate import calibrate, calibrated_hardware, signal_latency
from hpmoe.regions.forward import lower_forward
from hpmoe.schedule import SchedulePolicy, WorkerCounts, schedule, schedule_from_assignment
from hpmoe.sim.presets import hardware_preset
from hpmoe.sim.simulate import Timeline, simulate
from hpmoe.spec import TileSpec

from .helpers import chain_graph, tiny_plan

KNOWN = dataclasses.replace(hardware_preset("h100"), matrix_workers=2, vector_workers=3,
                            matrix_flops_fp32=1e11, mem_bw=6e12, vector_flops=1e16, task_overhead=2e-6,
                            shared_hbm=False, matrix_memory=False, unpermute_traffic=2.5,
                            matrix_efficiency=1.0, matrix_full_edge=1, stream_bw=0.0)


@pytest.mark.parametrize("policy", [SchedulePolicy.HYPERPARALLEL, SchedulePolicy.CRITICAL_PATH])
def test_the_fit_recovers_the_model_that_made_the_timeline(policy):
    plan = tiny_plan(ep=1, tokens=64)
    g = lower_forward(plan, TileSpec(rows=16, gemm_rows=32, gemm_cols=16))
    s = schedule(g, policy, KNOWN)
    measured = simulate(s, KNOWN).timeline
    cal = calibrate(s, measured)
    assert cal.task_overhead == pytest.approx(2e-6, rel=1e-6)
    assert cal.matrix_flops == pytest.approx(1e11, rel=1e-6)
    assert cal.copy_bandwidth == pytest.approx(6e12 / 3, rel=1e-6)
    assert cal.unpermute_traffic == pytest.approx(2.5, rel=1e-6)
    assert cal.signal_latency == pytest.approx(0.0, abs=1e-12) and cal.residual < 1e-9
    model = calibrated_hardware(hardware_preset("h100"), cal, s, torch.float32)
    assert simulate(s, model).makespan == pytest.approx(measured.makespan, rel=1e-9)


def test_the_gap_from_a_signal_to_the_start_it_releases_is_the_signal_latency():
    g = chain_graph(waits=[-1, 0, -1], signals=[[0], [], []], thresholds=[1])
    s = schedule_from_assignment(g, SchedulePolicy.SERIAL, WorkerCounts(1, 2), np.array([0, 1, 0]),
                                 np.arange(3))
    nan = np.full(3, np.nan)
    tl = Timeline(ep=1, workers=s.workers, kind=g.kind, rank=g.rank, peer=g.peer, unit=g.unit,
                  worker=s.worker, start=np.array([0.0, 4e-6, 1e-6]), end=np.array([1e-6, 5e-6, 2e-6]),
                  link_start=nan, link_end=nan)
    assert signal_latency(s, tl) == pytest.approx(3e-6)


def test_a_timeline_of_another_graph_is_refused():
    plan = tiny_plan(ep=1, tokens=64)
    g = lower_forward(plan, TileSpec(rows=16, gemm_rows=32, gemm_cols=16))
    s = schedule(g, SchedulePolicy.SERIAL, KNOWN)
    tl = simulate(s, KNOWN).timeline
    fields = ("kind", "rank", "peer", "unit", "worker", "start", "end", "link_start", "link_end")
    short = dataclasses.replace(tl, **{f: getattr(tl, f)[:-1] for f in fields})
    with pytest.raises(ValueError, match="tasks"):
        calibrate(s, short)
    assert np.isfinite(tl.makespan)


def test_matrix_tasks_are_charged_no_bytes_in_a_model_fitted_to_their_durations():
    from hpmoe.ir.graph import Unit
    from hpmoe.sim.cost import memory_time
    g = lower_forward(tiny_plan(ep=1, tokens=64), TileSpec(rows=16, gemm_rows=32, gemm_cols=16))
    matrix = g.unit == Unit.MATRIX
    slow = dataclasses.replace(KNOWN, mem_bw=1e6)
    bound = memory_time(g, dataclasses.replace(slow, matrix_memory=True))
    free = memory_time(g, slow)
    assert (bound[matrix] > 0).all() and (free[matrix] == 0).all()
    assert np.array_equal(bound[~matrix], free[~matrix])
    with pytest.raises(ValueError, match="matrix_memory=False needs shared_hbm=False"):
        dataclasses.replace(slow, shared_hbm=True)

"""The strongest kernel-by-kernel baseline and the paper's region, against hand-made routings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpmoe.ir.graph import TaskKind
from hpmoe.regions.forward import lower_forward
from hpmoe.routing import RoutingKind, plan_routing
from hpmoe.schedule import serial_schedule, verify_schedule
from hpmoe.schedule.baseline import dedup_puts, dedup_ratio, paper_region, strongest_baseline
from hpmoe.sim.cost import task_costs
from hpmoe.sim.presets import hardware_preset
from hpmoe.sim.simulate import simulate
from hpmoe.spec import MoESpec, ParallelSpec, TileSpec

from .helpers import tiny_plan

MOE = MoESpec(hidden=8, ffn=4, experts=4, top_k=2, shared_experts=1, dtype=torch.float32)


def hand_plan():
    """EP 2, experts 0-1 on rank 0, 2-3 on rank 1.  Rank 0: token 0 -> (0, 1), token 1 ->
    (2, 3): one token per destination for two rows.  Rank 1: (0, 2), (1, 3): one row each."""
    ids = torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3]])
    return plan_routing(ids, MOE, ParallelSpec(ep=2, tokens_per_rank=2))


def test_dedup_ratio_is_distinct_tokens_over_rows():
    plan = hand_plan()
    g = lower_forward(plan, TileSpec(rows=4, gemm_rows=4, gemm_cols=4))
    assert dedup_ratio(plan).tolist() == [[0.5, 0.5], [1.0, 1.0]]
    d = dedup_puts(g, plan)
    remote = (g.link_bytes > 0)
    for kind in (TaskKind.DISPATCH, TaskKind.COMBINE):
        m = remote & (g.kind == kind)
        src = g.rank[m] if kind == TaskKind.DISPATCH else g.peer[m]
        expect = np.where(src == 0, 0.5, 1.0) * g.link_bytes[m]
        assert np.allclose(d.link_bytes[m], expect)


def test_strongest_baseline_overlaps_shared_experts_and_frees_the_permute():
    plan = tiny_plan(RoutingKind.GROUPED, ep=4, tokens=64)
    g = lower_forward(plan, TileSpec(8, 8, 8))
    hw = hardware_preset("ascend-a3")
    workers = hw.workers
    s = strongest_baseline(g, plan, workers)
    verify_schedule(s)
    r, serial = simulate(s, hw), simulate(serial_schedule(g, workers), hw)
    assert r.makespan < serial.makespan
    assert task_costs(s.graph, hw).floor[g.kind == TaskKind.PERMUTE].max() == 0.0
    shared = g.kind == TaskKind.SHARED_UP
    dispatch = g.kind == TaskKind.DISPATCH
    assert r.timeline.start[shared].max() < r.timeline.end[dispatch].max()  # beside the dispatch


def test_paper_region_frees_what_the_paper_runs_outside():
    g = paper_region(lower_forward(tiny_plan(RoutingKind.GROUPED, ep=2, tokens=16), TileSpec(4, 4, 8)))
    c = task_costs(g, hardware_preset("ascend-a3"))
    outside = np.isin(g.kind, [TaskKind.PERMUTE, TaskKind.UNPERMUTE, TaskKind.SHARED_UP,
                               TaskKind.SHARED_SWIGLU, TaskKind.SHARED_DOWN])
    assert (c.floor[outside] == 0).all() and (c.floor[~outside] > 0).all()
    assert pytest.approx(0.0) == float(c.work[outside].sum())

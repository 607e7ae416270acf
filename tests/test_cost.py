"""Cost model: roofline per task, GEMM padding, put costs per direction, lowered graphs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hpmoe.ir.graph import IS_PUT, TaskKind, Unit
from hpmoe.regions.forward import lower_forward
from hpmoe.routing import RoutingKind
from hpmoe.sim.cost import gemm_dims, task_costs
from hpmoe.sim.hardware import LinkDirection
from hpmoe.sim.presets import hardware_preset
from hpmoe.spec import TileSpec

from .handmade import UNIT_HW, US, Task, build, gemm, put, vec
from .helpers import tiny_plan


def test_compute_bound_tasks_cost_their_flops():
    c = task_costs(build(1, [gemm(2), vec(3)], {}), UNIT_HW)
    assert list(np.round(c.work / US, 9)) == [2, 3]
    assert list(c.transfer) == [0, 0] and list(c.latency) == [0, 0]


def test_gemm_dims_are_padded_to_the_matrix_block():
    hw = dataclasses.replace(UNIT_HW, matrix_block=16)
    g = build(1, [Task(TaskKind.GEMM_UP, flops=2 * 1 * 1 * 20)], {})  # m = n = 1, k = 20
    assert [float(x[0]) for x in gemm_dims(g)] == [1, 1, 20]
    assert task_costs(g, hw).work[0] == pytest.approx(2 * 16 * 16 * 32 / 1e12)


def test_memory_bound_task_uses_its_units_share_of_bandwidth():
    hw = dataclasses.replace(UNIT_HW, mem_bw=1e9, task_overhead=0.5e-6)
    g = build(1, [vec(1, bytes=3000.0), gemm(1, bytes=500.0)], {})
    c = task_costs(g, hw)
    # vector: 3000 B over 1e9 / 2 workers = 6 µs > 1 µs of flops; matrix: 0.5 µs < 1 µs
    assert list(np.round(c.work / US, 9)) == [6.5, 1.5]


def test_remote_puts_cost_issue_transfer_and_latency_per_direction():
    hw = dataclasses.replace(UNIT_HW, task_overhead=0.25e-6)
    g = build(2, [put(0, 1, 3), put(0, 1, 3, kind=TaskKind.COMBINE), put(0, 0, 3)], {})
    c = task_costs(g, hw)
    assert list(np.round(c.work / US, 9)) == [0.25, 0.25, 0.25 + 6000 * 2 / 1e18 / US]
    assert list(np.round(c.transfer / US, 9)) == [3, 6, 0]  # combine link: 0.5 GB/s
    assert list(np.round(c.latency / US, 9)) == [1, 1, 0]
    assert list(np.round(c.duration / US, 9))[:2] == [4.25, 7.25]


def test_host_cpu_per_put_leaves_every_task_cost_alone():
    """``put_cpu`` 2 µs: a remote put's worker time, transfer and latency are unchanged,
    and a local put's and a GEMM's too (the replay with host cores charges it beside the
    put: ``test_host_cores``)."""
    hw = dataclasses.replace(UNIT_HW, task_overhead=0.25e-6, put_cpu=2e-6)
    g = build(2, [put(0, 1, 3), put(0, 0, 3), gemm(1)], {})
    c, plain = task_costs(g, hw), task_costs(g, dataclasses.replace(hw, put_cpu=0.0))
    for name in ("work", "floor", "transfer", "latency"):
        assert list(getattr(c, name)) == list(getattr(plain, name)), name


def test_put_bandwidth_follows_the_ep_size():
    hw = hardware_preset("ascend-a3")
    for ep, bw in ((8, 146e9), (64, 81e9)):
        g = build(ep, [put(0, 1, 1)], {})
        c = task_costs(g, hw)  # one lane of a port of ``lanes`` streams
        assert c.transfer[0] / c.lanes[0] == pytest.approx(1000 / bw)
        assert c.lanes[0] == round(bw / hw.stream_bw)
        assert hw.link_bandwidth(ep, LinkDirection.DISPATCH) == bw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowered_graph_costs(dtype):
    plan = tiny_plan(RoutingKind.ZIPF, ep=2, tokens=16)
    moe = plan.moe.with_dtype(dtype)
    plan = dataclasses.replace(plan, moe=moe)
    g = lower_forward(plan, TileSpec(4, 4, 8))
    hw = hardware_preset("ascend-a3")
    assert g.dtype == dtype
    c = task_costs(g, hw)
    assert np.isfinite(c.duration).all() and (c.work >= hw.task_overhead).all()
    m, n, k = gemm_dims(g)
    depth = np.where(np.isin(g.kind, [TaskKind.GEMM_UP, TaskKind.SHARED_UP]), moe.hidden,
                     np.where(g.kind == TaskKind.GEMM_DOWN, moe.ffn, moe.shared_ffn))
    matrix = g.unit == Unit.MATRIX
    assert (k[matrix] == depth[matrix]).all()
    remote = IS_PUT[g.kind] & (g.link_bytes > 0)
    assert ((c.transfer > 0) == remote).all()
    rate = hw.matrix_flops(dtype)
    assert (c.work[matrix] >= g.flops[matrix] / rate).all()

"""Packing a schedule into the GPU backend's int32 arrays, and the arena (no triton needed)."""

import dataclasses

import numpy as np
import pytest
import torch

from hpmoe.gpu.buffers import FIELDS, Arena, Elem, buffer_space
from hpmoe.gpu.ops import COL, NCOL, Op, describe
from hpmoe.gpu.pack import pack, pack_tasks
from hpmoe.ir.graph import TaskKind
from hpmoe.regions.backward import lower_backward
from hpmoe.regions.forward import lower_forward
from hpmoe.schedule import QUEUE_POLICIES, SchedulePolicy, WorkerCounts, schedule
from hpmoe.sim.presets import hardware_preset

from .helpers import TINY_TILES, tiny_plan

HW = dataclasses.replace(hardware_preset("h100"), matrix_workers=2, vector_workers=3)


@pytest.fixture(scope="module")
def plan():
    return tiny_plan(ep=2, tokens=8)


@pytest.mark.parametrize("policy", QUEUE_POLICIES)
def test_pack_is_a_pure_function_of_the_schedule(plan, policy):
    s = schedule(lower_forward(plan, TINY_TILES), policy, HW)
    a, b = pack(s, buffer_space(plan)), pack(s, buffer_space(plan))
    for name, arr in a.arrays().items():
        assert arr.dtype == np.int32 and arr.flags.c_contiguous, name
        assert np.array_equal(arr, b.arrays()[name]), name


def test_packed_waits_signals_and_queues_are_the_schedules(plan):
    g = lower_backward(plan, TINY_TILES)
    s = schedule(g, SchedulePolicy.CRITICAL_PATH, HW)
    p = pack(s, buffer_space(plan))
    assert p.num_queues == plan.par.ep * 5 and len(p.queue_names) == p.num_queues
    assert np.array_equal(p.queue_task, s.queue_task) and np.array_equal(p.queue_ptr, s.queue_ptr)
    assert np.array_equal(p.wait_event, g.wait_global())
    waits = g.wait_global() >= 0
    assert np.array_equal(p.wait_threshold[waits], g.threshold[g.wait_global()[waits]])
    assert np.array_equal(p.sig_event, g.signals_global()) and np.array_equal(p.sig_ptr, g.sig_ptr)
    assert p.tasks.shape == (g.num_tasks, NCOL)
    assert np.array_equal(p.tasks[:, COL["kind"]], g.kind)


def test_puts_write_the_peers_buffer_and_everything_else_its_own(plan):
    g = lower_forward(plan, TINY_TILES)
    space = buffer_space(plan)
    rows = describe(g, space)
    c_rank = rows[:, COL["c_buf"]] % space.ep
    put = np.isin(g.kind, [TaskKind.DISPATCH, TaskKind.COMBINE])
    assert np.array_equal(c_rank[put], g.peer[put]) and np.array_equal(c_rank[~put], g.rank[~put])
    assert (rows[put, COL["op"]] == Op.COPY).all()


def test_operands_stay_inside_their_buffers(plan):
    """Every operand row range of every task lies inside its buffer (forward and backward)."""
    space = buffer_space(plan)
    for g in (lower_forward(plan, TINY_TILES), lower_backward(plan, TINY_TILES, recompute=True)):
        rows = describe(g, space)
        for op in ("a", "b", "c"):
            buf = rows[:, COL[f"{op}_buf"]]
            used = buf >= 0
            nrows = space.rows.reshape(-1)[buf[used]]
            assert (rows[used, COL[f"{op}_row"]] >= 0).all()
            assert (rows[used, COL[f"{op}_row"]] < np.maximum(nrows, 1)).all(), op


def test_pack_tasks_deals_tasks_round_robin_without_waits(plan):
    g = lower_forward(plan, TINY_TILES)
    ids = np.flatnonzero(g.kind == TaskKind.GEMM_UP)
    p = pack_tasks(g, buffer_space(plan), ids, 3)
    assert p.num_queues == 3 and sorted(p.queue_task.tolist()) == sorted(ids.tolist())
    assert (p.wait_event == -1).all() and p.sig_ptr.max() == 0
    with pytest.raises(ValueError, match="queues"):
        pack_tasks(g, buffer_space(plan), ids, 0)


def test_pack_refuses_a_partial_graph_and_a_foreign_space(plan):
    g = lower_forward(plan, TINY_TILES, ranks=(0,))
    with pytest.raises(ValueError, match="every rank"):
        pack(_with_graph(plan, g), buffer_space(plan))
    s = schedule(lower_forward(plan, TINY_TILES), SchedulePolicy.SERIAL, HW)
    with pytest.raises(ValueError, match="ep=1"):
        pack(s, buffer_space(tiny_plan(ep=1, tokens=8)))


def _with_graph(plan, g):
    s = schedule(lower_forward(plan, TINY_TILES), SchedulePolicy.SERIAL, HW)
    return dataclasses.replace(s, graph=g)


def test_arena_regions_are_disjoint_nan_filled_and_checked(plan):
    space = buffer_space(plan)
    arena = Arena(space, torch.bfloat16, "cpu")
    spans = []
    for f in FIELDS:
        if not f.work:
            continue
        for r in range(space.ep):
            v = arena.rank_view(f.name, r)
            assert tuple(v.shape) == space.shape(f.name, r)
            if f.elem is not Elem.I32:
                assert v.isnan().all()
            if v.numel():
                spans.append((f.elem, v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()))
    for elem in Elem:
        s = sorted((a, b) for e, a, b in spans if e is elem)
        assert all(b0 <= a1 for (_, b0), (a1, _) in zip(s, s[1:], strict=False))
    with pytest.raises(ValueError, match="x"):
        arena.bind("x", torch.zeros(3, plan.moe.hidden, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        arena.bind("x", torch.zeros(16, plan.moe.hidden))


def test_workers_of_a_schedule_name_the_queues(plan):
    s = schedule(lower_forward(plan, TINY_TILES), SchedulePolicy.HYPERPARALLEL,
                 dataclasses.replace(HW, matrix_workers=1, vector_workers=1))
    p = pack(s, buffer_space(plan))
    assert p.queue_names == ("rank 0 matrix worker 0", "rank 0 vector worker 0", "rank 1 matrix worker 0",
                             "rank 1 vector worker 0")
    assert s.workers == WorkerCounts(1, 1)


def test_the_retired_call_count_names_warn_and_keep_their_meaning(plan):
    """Calls kept their counters once; now each starts from zero (one release of warnings)."""
    g = lower_forward(plan, TINY_TILES)
    p = pack(schedule(g, SchedulePolicy.SERIAL, HW), buffer_space(plan))
    waits = p.wait_event >= 0
    with pytest.warns(DeprecationWarning, match="PackedProgram.wait_step"):
        step = p.wait_step
    signals = np.bincount(p.graph.signals_global(), minlength=p.graph.num_events)
    assert np.array_equal(step[waits], signals[p.wait_event[waits]])
    assert not step[~waits].any()
    with pytest.warns(DeprecationWarning, match=r"PackedProgram.max_calls\(\)"):
        assert p.max_calls() == np.iinfo(np.int32).max
    ids = np.flatnonzero(p.graph.kind == p.graph.kind[0])
    with pytest.warns(DeprecationWarning, match="gpu.ops.Tasks"):
        from hpmoe.gpu.ops import Tasks
    selected = Tasks.of(p.graph, ids)
    assert np.array_equal(selected.row0, p.graph.row0[ids]) and selected.rank.dtype == np.int64

"""The GPU region's matrix/vector split is chosen by measuring (``hpmoe.gpu.split``):
the candidates, the choice of the fastest, a late run never chosen, and the choice kept
per key.  The timer here is a stand-in for CUDA-event runs on the region's arena."""

import math

import pytest
import torch

pytest.importorskip("triton")

from hpmoe.gpu import split  # noqa: E402
from hpmoe.gpu.residency import split_workers  # noqa: E402
from hpmoe.regions.forward import lower_forward  # noqa: E402
from hpmoe.schedule import SchedulePolicy  # noqa: E402
from hpmoe.sim.presets import hardware_preset  # noqa: E402
from hpmoe.spec import TileSpec  # noqa: E402

from .helpers import tiny_plan  # noqa: E402

HW = hardware_preset("h100")


@pytest.fixture
def graph():
    return lower_forward(tiny_plan(ep=2, tokens=64), TileSpec(rows=16, gemm_rows=32, gemm_cols=64))


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.setattr(split, "_CHOSEN", {})


def test_the_candidates_are_the_models_split_and_the_shares_once_each(graph):
    got = split.candidates(graph, HW, 20)
    assert got[0] == split_workers(graph, HW, 20)
    assert {w.matrix for w in got} >= {10, 12, 14, 16} and len(got) == len(set(got))
    assert all(w.per_rank == 20 and w.matrix >= 1 and w.vector >= 1 for w in got)
    assert all(w.per_rank == 2 for w in split.candidates(graph, HW, 2))


def test_the_fastest_split_is_scheduled_and_kept_for_its_key(graph):
    seen = []

    def timer(sched):
        seen.append(sched.workers.matrix)
        return {14: 1.0, 16: math.inf}.get(sched.workers.matrix, 2.0)

    key = split.split_key(graph, SchedulePolicy.HYPERPARALLEL, torch.bfloat16, None, 20)
    best = split.measured_schedule(graph, SchedulePolicy.HYPERPARALLEL, HW, key, 20, timer)
    assert best.workers.matrix == 14
    assert sorted(seen) == sorted(w.matrix for w in split.candidates(graph, HW, 20))
    again = split.measured_schedule(graph, SchedulePolicy.HYPERPARALLEL, HW, key, 20, pytest.fail)
    assert again.workers == best.workers


def test_a_split_whose_run_was_late_is_never_chosen(graph):
    key = split.split_key(graph, SchedulePolicy.SERIAL, torch.bfloat16, None, 10)
    best = split.measured_schedule(graph, SchedulePolicy.SERIAL, HW, key, 10,
                                   lambda s: 0.5 if s.workers.matrix == 5 else math.inf)
    assert best.workers.matrix == 5


def test_the_key_keeps_routing_noise_and_separates_other_regions(graph):
    k = split.split_key(graph, SchedulePolicy.HYPERPARALLEL, torch.bfloat16, None, 20)
    assert k == split.split_key(graph, SchedulePolicy.HYPERPARALLEL, torch.bfloat16, None, 20)
    assert k != split.split_key(graph, SchedulePolicy.SERIAL, torch.bfloat16, None, 20)
    assert k != split.split_key(graph, SchedulePolicy.HYPERPARALLEL, torch.bfloat16, None, 10)
    big = lower_forward(tiny_plan(ep=2, tokens=512), TileSpec(rows=16, gemm_rows=32, gemm_cols=64))
    assert k != split.split_key(big, SchedulePolicy.HYPERPARALLEL, torch.bfloat16, None, 20)

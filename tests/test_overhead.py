"""The executor-cost measurements of ``hpmoe.bench.overhead``: their graphs have the
hand-offs they claim, and they run to a finite figure (timings are never asserted)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hpmoe.bench.overhead import (
    EmptyShape,
    cpu_ticks,
    empty_graph,
    host_ticks,
    loaded_cost,
    loaded_graph,
    steal_fraction,
)
from hpmoe.ir.graph import TaskKind, Unit

from .helpers import burn


def test_loaded_graph_has_each_swiglu_wait_for_its_own_gemm() -> None:
    g = loaded_graph(5)
    gemm, swiglu = np.flatnonzero(g.kind == TaskKind.GEMM_UP), np.flatnonzero(g.kind == TaskKind.SWIGLU)
    assert len(gemm) == len(swiglu) == 5
    assert (g.unit[gemm] == Unit.MATRIX).all() and (g.unit[swiglu] == Unit.VECTOR).all()
    assert (g.wait[gemm] == -1).all()
    signalled = {int(g.sig_event[j]): int(t) for t in gemm for j in range(g.sig_ptr[t], g.sig_ptr[t + 1])}
    assert [signalled[int(g.wait[t])] for t in swiglu] == list(gemm)


def test_ping_pong_alternates_units_along_one_chain() -> None:
    g, position = empty_graph(6, EmptyShape.PING_PONG)
    order = np.argsort(position)
    assert list(g.unit[order]) == [Unit.MATRIX, Unit.VECTOR] * 3


def test_loaded_cost_leaves_the_kernels_cpu_out() -> None:
    """Kernels that each burn 4 ms of their thread's CPU: the figure is the executor's
    share only (well under a millisecond a task), not the 4 ms the kernels spent; a
    vector kernel that burns the same CPU under load as alone has no slowdown."""
    kernels = (lambda: burn(4e-3), lambda: burn(4e-3))
    cost = loaded_cost(n=10, repeats=1, kernels=kernels, alone_s=0.02)
    assert 0 <= cost.outside_s < 1e-3
    assert cost.vector_slowdown == pytest.approx(1.0, abs=0.05)


def test_loaded_cost_launch_is_the_region_outside_its_workers() -> None:
    """10 GEMM tasks of 4 ms each keep the workers busy for at least 40 ms; the launch
    (before the first task, after the last) leaves that time out."""
    cost = loaded_cost(n=10, repeats=1, kernels=(lambda: burn(4e-3), lambda: None), alone_s=0.02)
    assert 0 <= cost.launch_s < 10e-3


def test_loaded_cost_reports_a_vector_kernel_slower_under_load() -> None:
    """A vector kernel that burns 4 ms alone (on the calling thread) and 12 ms under load
    (on the executor's vector worker): a slowdown of 3.  (With 1 and 3 ms, what ``burn``
    overshoots per call once read 2.82.)"""
    caller = threading.current_thread()

    def vector() -> None:
        burn(4e-3 if threading.current_thread() is caller else 12e-3)
    cost = loaded_cost(n=10, repeats=1, kernels=(lambda: burn(1e-3), vector), alone_s=0.04)
    assert cost.vector_slowdown == pytest.approx(3.0, rel=0.05)


def test_steal_is_the_hypervisors_share_of_the_cpu_time_between_two_readings() -> None:
    """/proc/stat's cpu line: user nice system idle iowait irq softirq steal guest guest_nice.
    Between the two readings 400 ticks passed, 20 of them stolen: 5%."""
    before = cpu_ticks("cpu  100 0 50 800 10 0 0 40 7 0")
    after = cpu_ticks("cpu  300 0 100 930 10 0 0 60 9 0")
    assert before == (40, 1000) and after == (60, 1400)
    assert steal_fraction(before, after) == pytest.approx(0.05)
    assert steal_fraction(None, after) is None and steal_fraction(after, after) is None
    with pytest.raises(ValueError, match="8 fields"):
        cpu_ticks("cpu  1 2 3")
    now = host_ticks()  # this host's own line parses (Linux)
    assert now is None or 0 <= now[0] <= now[1]

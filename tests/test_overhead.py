"""The executor-cost measurements of ``hpmoe.bench.overhead``: their graphs have the
hand-offs they claim, and they run to a finite figure (timings are never asserted)."""

from __future__ import annotations

import time

import numpy as np

from hpmoe.bench.overhead import EmptyShape, empty_graph, loaded_cpu_per_task, loaded_graph
from hpmoe.ir.graph import TaskKind, Unit


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


def _burn(seconds: float) -> None:
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


def test_loaded_cpu_per_task_leaves_the_kernels_cpu_out() -> None:
    """Kernels that each burn 4 ms of their thread's CPU: the figure is the executor's
    share only (well under a millisecond a task), not the 4 ms the kernels spent."""
    burn = (lambda: _burn(4e-3), lambda: _burn(4e-3))
    assert 0 <= loaded_cpu_per_task(n=10, repeats=1, kernels=burn) < 1e-3

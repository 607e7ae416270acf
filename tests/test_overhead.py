"""The executor-cost measurements of ``hpmoe.bench.overhead``: their graphs have the
hand-offs they claim, and each figure is what it claims on a clock the test drives
(``KernelClock``: the kernels and the injected work advance it, nothing else), so no
timing of this host is asserted.  ``benchmarks/bench_runtime.py`` measures them."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import hpmoe.bench.overhead as overhead
import hpmoe.runtime.executor as executor_module
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
from hpmoe.runtime.transport.local import LocalTransport

from .helpers import KernelClock


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


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> KernelClock:
    """The measurement's clocks and the executor's timeline stamps on one ``KernelClock``:
    only the kernels (and what a test injects) advance it."""
    c = KernelClock()
    monkeypatch.setattr(overhead, "time", c.time_module())
    monkeypatch.setattr(overhead, "process_cpu", c.process_cpu)
    monkeypatch.setattr(executor_module, "time", c.time_module())
    return c


def test_loaded_cost_leaves_the_kernels_cpu_out(clock: KernelClock) -> None:
    """Kernels that each compute 4 ms on their thread, around which the process spends
    0.1 ms that no kernel's thread clock sees (the executor's share): the figure is that
    0.1 ms a task, not the 4 ms the kernels spent; a vector kernel that computes as long
    under load as alone has no slowdown."""
    def kernel() -> None:
        clock.spend(4e-3)
        clock.outside(1e-4)
    cost = loaded_cost(n=10, repeats=1, kernels=(kernel, kernel), alone_s=0.02)
    assert cost.outside_s == pytest.approx(1e-4, rel=1e-6)
    assert cost.vector_slowdown == pytest.approx(1.0, rel=1e-9)


def test_loaded_cost_launch_is_the_region_outside_its_workers(clock: KernelClock,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """10 GEMM tasks of 4 ms each keep the workers busy for 40 ms; finishing the region
    after its last task takes 5 ms: the launch is those 5 ms, not the 40."""
    finish = LocalTransport.finish
    monkeypatch.setattr(LocalTransport, "finish", lambda self: (clock.idle(5e-3), finish(self))[1])
    cost = loaded_cost(n=10, repeats=1, kernels=(lambda: clock.spend(4e-3), lambda: clock.spend(1e-4)),
                       alone_s=0.02)
    assert cost.launch_s == pytest.approx(5e-3, rel=1e-6)


def test_loaded_cost_reports_a_vector_kernel_slower_under_load(clock: KernelClock) -> None:
    """A vector kernel that computes 4 ms alone (on the calling thread) and 12 ms under
    load (on the executor's vector worker): a slowdown of 3."""
    caller = threading.current_thread()

    def vector() -> None:
        clock.spend(4e-3 if threading.current_thread() is caller else 12e-3)
    cost = loaded_cost(n=10, repeats=1, kernels=(lambda: clock.spend(1e-3), vector), alone_s=0.04)
    assert cost.vector_slowdown == pytest.approx(3.0, rel=1e-9)


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

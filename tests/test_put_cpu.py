"""``bench.forecast.measure_put_cpu``: the CPU per put of the ``dist`` transport, with
the compute between puts taken out, on a clock the test drives (``KernelClock``): the
compute between puts and the receiving threads' work are injected, the puts are real,
and the figure is exact (no timing of this host is asserted; ``hpmoe bench`` measures
it, as ``put_cpu_us``)."""

from __future__ import annotations

import pytest

import hpmoe.bench.forecast as forecast
from hpmoe.bench.forecast import measure_put_cpu
from hpmoe.testing import spawn_gloo

from .helpers import KernelClock

COMPUTE_S = 0.02  # the compute between two puts, on the sending thread
RECEIVE_S = {0: 1e-4, 1: 3e-4}  # each rank's CPU to receive one put, on its receiving threads
PUTS = 4


def _put_cpu(rank: int, world: int) -> float:
    clock = KernelClock()
    receive = forecast._receive

    def receiving(works: list) -> None:  # one (data, header) pair a put
        receive(works)
        clock.outside(len(works) * RECEIVE_S[rank])
    forecast.time, forecast.process_cpu, forecast._receive = clock.time_module(), clock.process_cpu, receiving
    return measure_put_cpu(None, 4096, lambda: clock.spend(COMPUTE_S), puts=PUTS, repeats=1)


def test_put_cpu_leaves_the_compute_between_puts_out() -> None:
    """Every put is followed by 20 ms of compute on the sending thread, and receiving a
    put costs rank 0 0.1 ms and rank 1 0.3 ms of CPU: the figure per put is the slowest
    rank's transport share, 0.3 ms, on every rank, not the 20 ms of compute."""
    per_put = spawn_gloo(_put_cpu, 2)
    assert per_put == [pytest.approx(RECEIVE_S[1], rel=1e-9)] * 2

"""``bench.forecast.measure_host_memory``: the host's memory bandwidth while every core
streams, summed over every copying thread of every rank (the copies' timings replaced by
a known one: timings are never asserted, only how they are combined)."""

from __future__ import annotations

import os

import pytest

from hpmoe.bench import forecast
from hpmoe.testing import spawn_gloo

NBYTES, SECONDS_PER_COPY = 1 << 20, 1e-3


def _host_memory(rank: int, world: int) -> tuple[float, int]:
    calls = []

    def one_copy(fn, seconds):  # the copy runs once and is said to take SECONDS_PER_COPY
        fn()
        calls.append(seconds)
        return SECONDS_PER_COPY, SECONDS_PER_COPY
    forecast.per_call = one_copy
    return forecast.measure_host_memory(None, NBYTES, seconds=0.01), len(calls)


def test_host_memory_sums_every_stream_of_every_rank() -> None:
    """Two ranks, each ``cores // 2`` streams (at least one) of 2 MiB read + write per
    millisecond: the figure is their sum, the same on both ranks."""
    streams = max(1, len(os.sched_getaffinity(0)) // 2)
    (total0, calls0), (total1, calls1) = spawn_gloo(_host_memory, 2)
    assert calls0 == calls1 == streams
    assert total0 == total1 == pytest.approx(2 * streams * 2 * NBYTES / SECONDS_PER_COPY)

"""``bench.forecast.measure_put_cpu``: the CPU per put of the ``dist`` transport, with
the compute between puts taken out (timings are never asserted, only what is counted)."""

from __future__ import annotations

from hpmoe.bench.forecast import measure_put_cpu
from hpmoe.testing import spawn_gloo

from .helpers import burn

BURN_S = 0.02


def _burn() -> None:
    burn(BURN_S)


def _put_cpu(rank: int, world: int) -> float:
    return measure_put_cpu(None, 4096, _burn, puts=4, repeats=1)


def test_put_cpu_leaves_the_compute_between_puts_out() -> None:
    """Every put is followed by 20 ms of its thread's CPU: the figure per put is the
    transport's share only, well under those 20 ms, and the same on every rank."""
    per_put = spawn_gloo(_put_cpu, 2)
    assert per_put[0] == per_put[1]
    assert 0 <= per_put[0] < BURN_S / 2

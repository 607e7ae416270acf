"""Every test runs without a saved cpu profile, whatever the machine has calibrated:
``SchedulePolicy.AUTO`` then forecasts nothing (one process: the kernel-by-kernel path;
an EP group: it tunes by measuring) unless a test passes a model.  Set before any test
(and any rank it spawns) starts."""

import os
import tempfile
from pathlib import Path

import pytest

os.environ["HPMOE_PROFILE"] = str(Path(tempfile.gettempdir()) / "hpmoe-tests-no-profile" / "cpu.json")


@pytest.fixture(autouse=True)
def _no_tuning_cache(tmp_path, monkeypatch):
    """Every test starts with an empty tuning cache of its own (spawned ranks inherit it):
    a choice tuned by one test must not settle another's."""
    monkeypatch.setenv("HPMOE_TUNE_CACHE", str(tmp_path / "hpmoe-tune.json"))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny GEMMs on one thread: two threads that spin for each other on shared, busy
    cores made each 8x16 product take milliseconds instead of microseconds.  A module
    asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

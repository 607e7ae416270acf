"""Failures end in a diagnosis on every rank within the deadline, never in a hang:
a rank killed mid-run, a rank whose puts never signal, an event threshold that
cannot be reached — on both transports; outside the region, a rank stopped before a
collective, one rank's bad input, ranks that disagree on dtype, tokens or weights.
No process and no /dev/shm segment of the job outlives it."""

from __future__ import annotations

import os
import sys

import pytest

from hpmoe.launch.launcher import LaunchResult, LaunchSpec, launch
from hpmoe.runtime.transport.segment import job_segments

from .fault_rank import DEADLINE as FAULT_DEADLINE
from .fault_rank import INPUT_CASES

DEADLINE = 2.0
BENCH = ("--preset", "tiny", "--tokens", "32", "--tile-rows", "8", "--gemm-rows", "8", "--gemm-cols", "16",
         "--iters", "1", "--warmup", "1", "--schedule", "hyperparallel", "--deadline", str(DEADLINE))


def _run(transport: str, fault: str) -> LaunchResult:
    argv = (sys.executable, "-m", "hpmoe", "bench", *BENCH, "--transport", transport, "--fault", fault)
    return launch(LaunchSpec(argv=argv, world=2, capture=True, timeout_s=90.0, grace_s=DEADLINE + 8.0))


def _assert_clean(result: LaunchResult) -> None:
    assert result.swept == (), f"segments left for the launcher to remove: {result.swept}"
    assert job_segments(result.job) == []
    for r in result.ranks:
        assert not os.path.exists(f"/proc/{r.pid}"), f"rank {r.rank} (pid {r.pid}) outlived the job"
        assert not r.stopped, f"rank {r.rank} had to be stopped by the launcher"


def _stopped_after(stderr: str) -> float | None:
    """Seconds in the report line ``rank r stopped after T s`` (None when absent)."""
    for line in stderr.splitlines():
        if " stopped after " in line:
            return float(line.split(" stopped after ")[1].split(" s")[0])
    return None


@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_a_rank_killed_mid_run_stops_every_rank_with_a_diagnosis(transport: str) -> None:
    result = _run(transport, "kill:1:3")
    _assert_clean(result)
    assert result.ranks[1].returncode == -9
    survivor = result.ranks[0]
    assert survivor.returncode == 1, survivor.stderr
    assert "hpmoe runtime: rank 0 stopped" in survivor.stderr
    first = survivor.stderr.splitlines()[0]
    assert any(name in first for name in ("rank 1 (pid", "from rank 1 failed", "to rank 1 failed")), first
    assert "waits task" in survivor.stderr and "last finished" in survivor.stderr
    assert _stopped_after(survivor.stderr) < DEADLINE


@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_a_rank_that_never_signals_is_diagnosed_at_the_deadline(transport: str) -> None:
    result = _run(transport, "silent:1")
    _assert_clean(result)
    for r in result.ranks:
        assert r.returncode == 1, r.stderr
        assert f"hpmoe runtime: rank {r.rank} stopped after" in r.stderr
        assert "counter 0 of threshold" in r.stderr
        assert _stopped_after(r.stderr) < DEADLINE + 1.0


@pytest.mark.parametrize(("transport", "rank"), [("shm", 0), ("dist", 1)])
def test_an_unreachable_threshold_is_diagnosed_at_the_deadline(transport: str, rank: int) -> None:
    result = _run(transport, f"unreachable:{rank}")
    _assert_clean(result)
    culprit = result.ranks[rank]
    assert culprit.returncode == 1
    assert "(deadline)" in culprit.stderr and "UNPERMUTE" in culprit.stderr
    assert DEADLINE <= _stopped_after(culprit.stderr) < DEADLINE + 1.0
    other = result.ranks[1 - rank]
    assert other.returncode == 1 and "stopped" in other.stderr


def _case(case: str, transport: str = "shm") -> LaunchResult:
    argv = (sys.executable, "-m", "tests.fault_rank", case, transport)
    return launch(LaunchSpec(argv=argv, world=2, capture=True, timeout_s=60.0, grace_s=1.0))


def _diagnosis(stderr: str, case: str) -> tuple[float, str]:
    """(seconds, message) of a rank's ``CASE: diagnosed after T s: message`` line."""
    line = next(x for x in stderr.splitlines() if x.startswith(f"{case}: diagnosed after "))
    seconds, message = line.removeprefix(f"{case}: diagnosed after ").split(" s: ", 1)
    return float(seconds), message


INPUT_MESSAGES = {
    "nan": "InputRejected: rank 1 rejected its input: x has NaN at row 13",
    "expert": "InputRejected: rank 1 rejected its input: routing.ids contains expert id 11, outside [0, 8)",
    "empty": "InputRejected: rank 1 rejected its input: x has no tokens (0 rows)",
    "dtype": "MismatchError: ranks disagree on 'forward region 5: agreement': dtype differs: "
             "rank 0 float32, rank 1 bfloat16",
    "tokens": "MismatchError: ranks disagree on 'forward region 6: agreement': tokens differs: "
              "rank 0 16, rank 1 12",
    "weights": "MismatchError: ranks disagree on 'forward region 7: agreement': weights_crc differs: rank 0 ",
}


def test_one_sided_inputs_and_mismatches_end_every_rank_with_the_same_named_cause_at_once() -> None:
    result = _case("inputs")
    _assert_clean(result)
    assert set(INPUT_MESSAGES) == set(INPUT_CASES)
    for r in result.ranks:
        assert r.returncode == 0 and r.stdout.strip() == "clean", r.stderr  # the session went on
        for case, message in INPUT_MESSAGES.items():
            seconds, said = _diagnosis(r.stderr, case)
            assert said.startswith(message), said
            assert seconds < FAULT_DEADLINE  # the agreement answers at once, not at the deadline


def test_a_rank_stopped_outside_the_region_is_named_by_its_peer_at_the_deadline() -> None:
    result = _case("stall")
    assert job_segments(result.job) == []
    stalled, survivor = result.ranks[1], result.ranks[0]
    assert stalled.stopped and stalled.returncode in (-15, -9)
    seconds, said = _diagnosis(survivor.stderr, "clean")
    assert "in 'forward region 2: count exchange': rank 1 did not arrive" in said, said
    assert "rank 1: 'forward region 2: agreement'" in survivor.stderr  # what it did last
    assert "(stopped or hung)" in survivor.stderr
    assert FAULT_DEADLINE <= seconds < FAULT_DEADLINE + 1.0

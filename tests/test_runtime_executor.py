"""The runtime's executor, counters, plan exchange, shared segments and heap, in one
process (no ranks): handmade graphs on the local transport."""

from __future__ import annotations

import gc
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch

import hpmoe.runtime.executor as executor_module
from hpmoe.exec.program import compile_program
from hpmoe.ir.graph import TaskKind, task_columns
from hpmoe.launch.netns import LinkSpec
from hpmoe.regions.base import Region
from hpmoe.regions.forward import lower_forward
from hpmoe.routing import RoutingKind, plan_routing, synthetic_routing
from hpmoe.runtime.counters import Counters
from hpmoe.runtime.executor import Executor, ExecutorConfig, gc_paused
from hpmoe.runtime.faults import Fault, FaultKind
from hpmoe.runtime.forensics import RegionError, WorkerStatus
from hpmoe.runtime.plan import plan_from_tile_counts, tile_counts
from hpmoe.runtime.session import RuntimeConfig
from hpmoe.runtime.transport.heap import HeapNeed, SymmetricHeap
from hpmoe.runtime.transport.local import LocalTransport
from hpmoe.runtime.transport.segment import (
    SHM_DIR,
    create_segment,
    job_segments,
    new_token,
    open_segment,
    segment_name,
    sweep,
    sweep_stale,
)
from hpmoe.spec import ParallelSpec, TileSpec, preset

from .handmade import build, by_hand, gemm, vec
from .helpers import KernelClock


class Log:
    """Kernels that append the task's column tile to a shared list (col0 = task id)."""

    def __init__(self, sleep_s: float = 0.0, fail_on: int = -1):
        self.seen: list[int] = []
        self.sleep_s, self.fail_on = sleep_s, fail_on

    def kernel(self, tile: object, me: object, peer: object, ctx: object) -> None:
        if tile.kind == TaskKind.GEMM_UP:
            time.sleep(self.sleep_s)
        if tile.row1 == self.fail_on:
            raise ValueError(f"kernel failure on purpose at row1={tile.row1}")
        self.seen.append(tile.kind)

    def region(self) -> Region:
        return Region(kind=None, lower=lambda *a: None, kernels={TaskKind.GEMM_UP: self.kernel,
                      TaskKind.SWIGLU: self.kernel}, puts={}, buffers=object, symmetric_shapes=lambda *a: {})


def _run(graph, workers, log: Log, deadline: float = 5.0, repeats: int = 1, transport=None,
         thread_cpu: bool = False):
    """Run the one-rank ``graph`` ``repeats`` times; returns the last RegionResult."""
    program = compile_program(by_hand(graph, workers), log.region(), 0)
    transport = transport or LocalTransport()
    executor = Executor(ExecutorConfig(deadline_s=deadline, poll_s=0.01, thread_cpu=thread_cpu))
    try:
        for _ in range(repeats):
            transport.begin()
            transport.prepare_events(program.num_events)
            result = executor.run(program, log.region(), None, None, transport)
        return result
    finally:
        executor.close()


def _chain():
    """GEMM (matrix) signals event 0; SWIGLU (vector) waits on it."""
    return build(1, [gemm(1, signals=[(0, 0)]), vec(1, wait=0)], {0: [1]})


def test_a_waiting_task_runs_after_its_event_and_counters_carry_over_regions() -> None:
    log = Log(sleep_s=0.02)
    res = _run(_chain(), [0, 0], log, repeats=3)
    assert log.seen == [TaskKind.GEMM_UP, TaskKind.SWIGLU] * 3
    tl = res.timeline
    start = dict(zip(tl.task.tolist(), tl.start.tolist(), strict=True))
    end = dict(zip(tl.task.tolist(), tl.end.tolist(), strict=True))
    assert start[1] >= end[0]  # the GEMM sleeps 20 ms: a SwiGLU that did not wait would start first
    assert tl.queue.tolist() == [0, 1]


class ClockLog(Log):
    """On a ``KernelClock``: GEMM tiles sleep 50 ms (wall time, no CPU), SwiGLU tiles
    compute 50 ms (wall time and their thread's CPU)."""

    def __init__(self, clock: KernelClock):
        super().__init__()
        self.clock = clock

    def kernel(self, tile: object, me: object, peer: object, ctx: object) -> None:
        if tile.kind == TaskKind.GEMM_UP:
            self.clock.idle(0.05)
        else:
            self.clock.spend(0.05)


def test_the_timeline_records_each_tasks_thread_cpu_not_its_wall_time(monkeypatch) -> None:
    """The executor's stamps on a clock only the kernels advance: a sleeping task spends
    50 ms of wall time and no CPU, a computing one 50 ms of both.  Not asked for, the CPU
    times are NaN."""
    clock = KernelClock()
    monkeypatch.setattr(executor_module, "time", clock.time_module())
    assert np.isnan(_run(_chain(), [0, 0], ClockLog(clock)).timeline.cpu).all()
    tl = _run(_chain(), [0, 0], ClockLog(clock), thread_cpu=True).timeline
    cpu = dict(zip(tl.task.tolist(), tl.cpu.tolist(), strict=True))
    wall = dict(zip(tl.task.tolist(), (tl.end - tl.start).tolist(), strict=True))
    assert (wall[0], cpu[0]) == (pytest.approx(0.05, abs=1e-9), 0.0)
    assert (wall[1], cpu[1]) == (pytest.approx(0.05, abs=1e-9), pytest.approx(0.05, abs=1e-9))


class GcLog(Log):
    """Kernels that record whether the cyclic collector is on while they run."""

    def __init__(self):
        super().__init__()
        self.gc_on: list[bool] = []

    def kernel(self, tile: object, me: object, peer: object, ctx: object) -> None:
        self.gc_on.append(gc.isenabled())


def test_the_collector_is_off_inside_a_region_and_restored_after() -> None:
    log = GcLog()
    assert gc.isenabled()
    _run(_chain(), [0, 0], log, repeats=2)
    assert log.gc_on == [False] * 4 and gc.isenabled()
    gc.disable()
    try:
        _run(_chain(), [0, 0], log)  # a caller that turned it off keeps it off
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_comes_back_only_when_the_last_region_of_the_process_ends() -> None:
    """Two ranks in one process (as the threads transport runs them): the first region
    to end leaves the collector off while the other still runs."""
    inside, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def hold() -> None:
        with gc_paused():
            inside.set()
            release.wait(5.0)
    t = threading.Thread(target=hold)
    t.start()
    inside.wait(5.0)
    with gc_paused():
        pass
    seen.append(gc.isenabled())
    release.set()
    t.join()
    assert seen == [False] and gc.isenabled()


class _Buffers:
    """A rank's buffer object, its liveness observable (``weakref``)."""


def test_nothing_of_a_region_holds_its_buffers_once_run_returns() -> None:
    """A region's expert gradients are rows of tensors autograd takes as ``.grad``: it
    takes them without a copy only when nothing else references them (a worker thread
    holding its last job's buffers made it copy 350 MB a training step)."""
    log = GcLog()
    program = compile_program(by_hand(_chain(), [0, 1]), log.region(), 0)
    transport, executor = LocalTransport(), Executor(ExecutorConfig())
    try:
        for _ in range(3):
            me = _Buffers()
            alive = weakref.ref(me)
            transport.begin()
            transport.prepare_events(program.num_events)
            executor.run(program, log.region(), me, None, transport)
            del me
            assert alive() is None
    finally:
        executor.close()


def test_a_region_may_leave_the_collector_alone() -> None:
    log = GcLog()
    program = compile_program(by_hand(_chain(), [0, 0]), log.region(), 0)
    transport, executor = LocalTransport(), Executor(ExecutorConfig(pause_gc=False))
    try:
        transport.begin()
        transport.prepare_events(program.num_events)
        executor.run(program, log.region(), None, None, transport)
    finally:
        executor.close()
    assert log.gc_on == [True, True]


def test_unreachable_threshold_ends_with_a_report_within_the_deadline() -> None:
    graph = build(1, [gemm(1, signals=[(0, 0)]), vec(1, wait=0)], {0: [2]})
    with pytest.raises(RegionError) as info:
        _run(graph, [0, 0], Log(), deadline=0.3)
    report = info.value.report
    waiting = [w for w in report.workers if w.status is WorkerStatus.WAITS]
    assert len(waiting) == 1 and "SWIGLU" in waiting[0].task
    assert (waiting[0].progress, waiting[0].threshold) == (1, 2)
    assert "deadline" in report.cause and "event r0:0" in report.cause
    finished = [w for w in report.workers if w.status is WorkerStatus.FINISHED]
    assert "GEMM_UP" in finished[0].last_done
    assert "counter 1 of threshold 2" in str(info.value)


def test_a_failing_kernel_stops_every_worker_and_names_the_task() -> None:
    graph = build(1, [gemm(1, signals=[(0, 0)]), vec(1, wait=0)], {0: [1]})
    graph = type(graph)(**{**graph.__dict__, "row1": np.array([7, 1])})
    with pytest.raises(RegionError) as info:
        _run(graph, [0, 0], Log(fail_on=7), deadline=5.0)
    report = info.value.report
    assert "ValueError" in report.cause and "GEMM_UP" in report.cause
    assert [w.status for w in report.workers] == [WorkerStatus.FAILED, WorkerStatus.WAITS,
                                                 WorkerStatus.FINISHED]
    # ended by the failure, not by the 5 s deadline: the waiting worker sees the abort
    # within a poll (10 ms); 5 s is 500 polls, more than a loaded host delays a wake-up
    assert report.elapsed_s < 5.0


def test_counters_progress_is_modulo_2_32() -> None:
    c = Counters.anonymous(2)
    c._array[0] = 2**31 - 1
    base = int(c.snapshot()[0])
    c.add(0, 2)
    assert c.value(0) == -(2**31) + 1 and c.progress(0, base) == 2
    c.add(1, 5000)
    assert c.progress(1, 0) == 5000


def test_a_sleeping_waiter_wakes_on_add() -> None:
    c = Counters.anonymous(1)
    threading.Timer(0.05, c.add, args=(0,)).start()
    t0 = time.monotonic()
    c.sleep(0, 0, 60.0)
    # woken, not timed out: the add comes after 50 ms; a sleep that missed it would end
    # at its 60 s timeout, 1200 times later, a margin no load on the host closes
    assert time.monotonic() - t0 < 60.0 and c.value(0) == 1


def test_a_signal_below_the_threshold_does_not_wake_the_waiter() -> None:
    """Counters.signal counts every add but wakes a sleeper only at ``need``: the
    sleeper stays asleep through the first two of three signals."""
    c = Counters.anonymous(1)
    woke: list[float] = []
    t = threading.Thread(target=lambda: (c.sleep(0, 0, 60.0), woke.append(time.monotonic())))
    t.start()
    time.sleep(0.2)  # the sleeper is asleep in the kernel by now
    c.signal(0, 0, 3)
    c.signal(0, 0, 3)
    time.sleep(0.2)
    asleep = not woke
    c.signal(0, 0, 3)
    t.join(10.0)
    assert c.value(0) == 3 and asleep and woke  # slept through 1 and 2, woken by 3


# ---------------------------------------------------------------------------- plan exchange

@pytest.mark.parametrize("kind", list(RoutingKind))
@pytest.mark.parametrize("ep", [2, 4])
def test_tile_counts_rebuild_every_ranks_graph_exactly(kind: RoutingKind, ep: int) -> None:
    """What each rank lowers from the exchanged counts equals the graph of all ids."""
    moe, tiles = preset("tiny"), TileSpec(rows=8, gemm_rows=8, gemm_cols=16)
    par = ParallelSpec(ep=ep, tokens_per_rank=20)
    ids = synthetic_routing(kind, moe, par, seed=5).ids
    true = lower_forward(plan_routing(ids, moe, par), tiles)
    per_rank = ids.view(ep, 20, moe.top_k)
    counts = torch.stack([tile_counts(per_rank[r], moe.experts, tiles.rows) for r in range(ep)])
    for me in range(ep):
        plan = plan_from_tile_counts(per_rank[me], counts, moe, par, me, tiles.rows)
        assert torch.equal(plan.order[me], plan_routing(ids, moe, par).order[me])
        mine = lower_forward(plan, tiles)
        for c in (*task_columns(), "sig_ptr", "sig_rank", "sig_event", "event_ptr", "threshold"):
            assert np.array_equal(getattr(mine, c), getattr(true, c)), c


def test_inconsistent_tile_counts_are_rejected() -> None:
    moe, par = preset("tiny"), ParallelSpec(ep=2, tokens_per_rank=8)
    ids = synthetic_routing(RoutingKind.BALANCED, moe, par, seed=0).ids.view(2, 8, -1)
    counts = torch.stack([tile_counts(ids[r], moe.experts, 4) for r in range(2)])
    counts[1, 0, 0] += 1
    with pytest.raises(ValueError, match="token counts per tile"):
        plan_from_tile_counts(ids[0], counts, moe, par, 0, 4)


# ---------------------------------------------------------------------------- configuration

def test_bad_configuration_names_the_field() -> None:
    with pytest.raises(ValueError, match="deadline_s"):
        RuntimeConfig(deadline_s=0)
    with pytest.raises(ValueError, match="threads"):
        RuntimeConfig(threads=0)
    with pytest.raises(ValueError, match=r"ExecutorConfig.pause_gc must be a bool, got 'no'"):
        ExecutorConfig(pause_gc="no")
    with pytest.raises(ValueError, match=r"ExecutorConfig.thread_cpu must be a bool, got 1"):
        RuntimeConfig(thread_cpu=1)
    with pytest.raises(TypeError, match="transport"):
        RuntimeConfig(transport="shm")
    with pytest.raises(ValueError, match="--link="):
        LinkSpec("2 gigabit")
    assert LinkSpec("2gbit").bytes_per_s == 2.5e8
    assert Fault.parse("kill:1:5") == Fault(FaultKind.KILL, 1, 5)
    with pytest.raises(ValueError, match="KIND:RANK"):
        Fault.parse("kill")


# ---------------------------------------------------------------------------- shared memory

def test_segments_are_private_exclusive_reserved_and_swept() -> None:
    job = new_token()
    seg = create_segment(segment_name(job, os.getpid(), new_token()), 4096)
    try:
        st = os.stat(SHM_DIR / seg.name)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        assert st.st_blocks * 512 >= 4096  # posix_fallocate reserved the pages
        with pytest.raises(FileExistsError):
            create_segment(seg.name, 4096)
        os.chmod(SHM_DIR / seg.name, 0o644)
        with pytest.raises(PermissionError):
            open_segment(seg.name, 4096)
    finally:
        seg.close()
        assert sweep(job) == [seg.name]
    assert job_segments(job) == []


def test_a_squatted_segment_name_is_retried_and_a_dead_owners_segment_is_swept() -> None:
    job, draws = new_token(), iter(["00000000000000aa", "00000000000000bb"])
    squat = create_segment(segment_name(job, os.getpid(), "00000000000000aa"), 4096)  # the next name
    heap = SymmetricHeap(job, 0, 1, [os.getpid()], lambda row: row[None], token=lambda: next(draws))
    try:
        assert heap.ensure([HeapNeed(events=4, fields=())]) == [0]
        assert job_segments(job) == [squat.name]  # ours was created as ...bb, mapped, unlinked
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout.strip()
        stale = create_segment(segment_name(job, int(dead), new_token()), 4096)
        assert sweep_stale() == [stale.name] and job_segments(job) == [squat.name]
        stale.close()
    finally:
        heap.close()
        squat.close()
        sweep(job)
    assert job_segments(job) == []


def test_heap_grows_by_generation_and_leaves_nothing_behind() -> None:
    job = new_token()
    heap = SymmetricHeap(job, 0, 1, [os.getpid()], lambda row: row[None])
    small = HeapNeed(events=10, fields=(("recv", (4, 8), torch.bfloat16), ("comb", (3, 8), torch.float32)))
    big = HeapNeed(events=5000, fields=(("recv", (400, 800), torch.bfloat16),))
    try:
        assert heap.ensure([small]) == [0] and heap.ensure([small]) == []
        views = heap.tensors(0, small)
        views["comb"].fill_(1.5)
        heap.counters(0).add(9)
        assert views["recv"].shape == (4, 8) and heap.counters(0).value(9) == 1
        assert job_segments(job) == []  # unlinked as soon as every rank mapped it
        assert heap.ensure([big]) == [0] and heap.counters(0).value(9) == 0
        assert heap.tensors(0, big)["recv"].shape == (400, 800)
    finally:
        heap.close()
    assert job_segments(job) == []


_PAUSED_CHILD = """
import sys, time
from hpmoe.ir.graph import TaskKind
from tests.test_runtime_executor import Log, _chain, _run

class Steps(Log):  # the GEMM takes 1 s of its own running time, in 50 ms steps
    def kernel(self, tile, me, peer, ctx):
        if tile.kind == TaskKind.GEMM_UP:
            print("running", flush=True)
            for _ in range(20):
                time.sleep(0.05)
        self.seen.append(tile.kind)

log = Steps()
_run(_chain(), [0, 0], log, deadline=2.0)
print("ok", log.seen == [TaskKind.GEMM_UP, TaskKind.SWIGLU], flush=True)
"""


def test_a_rank_stopped_and_resumed_does_not_blame_itself_for_the_time_it_was_stopped() -> None:
    """Stopped for 3 s mid-region (deadline 2 s), the rank finishes once continued: the
    time it did not run counts neither against the waiting task nor the watchdog."""
    child = subprocess.Popen([sys.executable, "-c", _PAUSED_CHILD], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "running"
        time.sleep(0.2)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(child.pid, signal.SIGCONT)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0 and out.strip() == "ok True", err


def test_a_daemon_thread_joined_from_itself_returns_and_stops_on_none():
    """A session collected on one of its own threads closes from there: joining that
    thread from itself returns at once instead of raising."""
    import queue

    t = executor_module.DaemonThread("hpmoe-test")
    said: queue.SimpleQueue = queue.SimpleQueue()
    t.jobs.put(lambda: said.put(t.join(1.0) or "returned"))
    assert said.get(timeout=5) == "returned"
    t.jobs.put(None)
    t.join(5.0)
    assert not t.thread.is_alive()

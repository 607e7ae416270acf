"""The executor: one thread per worker, each walking its static queue.

For every task in queue order a worker (1) waits until the task's event counter
has grown by the event's threshold since the region's snapshot, sleeping on the
counter's futex with a deadline, (2) runs the kernel, or asks the transport for
the put, and (3) signals its local events, waking their waiters only when an
event reaches its threshold (a waiter on 32 tiles sleeps through the first 31:
each wake-up is a context switch and a turn of the interpreter lock taken from
the threads doing work).  There is no barrier inside the
region.  Torch releases the GIL inside its ops, so matrix and vector workers
overlap.  Every wait has a deadline; a failed region ends with a ``RegionError``
whose report says which worker waits on which task and event.

The interpreter's cyclic garbage collector is held off while a region runs
(``gc_paused``): a collection stops every Python thread of the process at once,
in the middle of the workers' hand-offs.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import queue as queue_mod
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..exec.program import RankProgram, task_calls
from ..regions.base import Region
from .counters import MASK
from .forensics import Aborted, HangReport, RegionError, WaitTimeout, WorkerReport, WorkerState, WorkerStatus
from .timeline import RunTimeline, timeline_from_records
from .transport.base import Transport


@dataclass(frozen=True)
class ExecutorConfig:
    """deadline_s: longest a task may wait on its event, and longest a region may
    go without finishing a task.  poll_s: how often a sleeping worker re-checks
    for aborts (bounds how fast a failure elsewhere stops it).  threads: torch
    intra-op threads of each worker (OpenMP's thread count is per calling thread,
    so each worker sets it; GEMM results depend on it bitwise).  pause_gc: hold the
    cyclic garbage collector off while the region runs (``gc_paused``).  thread_cpu:
    record each task's worker-thread CPU time (``RunTimeline.cpu``; two clock reads a
    task, about 2 µs here, hence off unless asked for; off: NaN)."""

    deadline_s: float = 60.0
    poll_s: float = 0.05
    threads: int = 1
    pause_gc: bool = True
    thread_cpu: bool = False

    def __post_init__(self) -> None:
        for name in ("deadline_s", "poll_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"ExecutorConfig.{name} must be a positive number, got {value!r}")
        if not isinstance(self.threads, int) or self.threads <= 0:
            raise ValueError(f"ExecutorConfig.threads must be a positive int, got {self.threads!r}")
        for name in ("pause_gc", "thread_cpu"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ExecutorConfig.{name} must be a bool, got {getattr(self, name)!r}")


class _GcPause:
    """Counts the regions of this process that run (ranks may share one: the
    ``threads`` transport) so that the collector is back, if it was on, only when
    the last one ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._restore = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._running == 0:
                self._restore = gc.isenabled()
                gc.disable()
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0 and self._restore:
                    gc.enable()


_GC_PAUSE = _GcPause()


def gc_paused(pause: bool = True) -> contextlib.AbstractContextManager[None]:
    """The cyclic garbage collector off inside (``pause``), as it was after the last
    region of the process ends.  Reference counting still frees whatever is not in a
    cycle; cycles made meanwhile wait for the next collection."""
    return _GC_PAUSE.held() if pause else contextlib.nullcontext()


def pause_s(config: ExecutorConfig) -> float:
    """A gap this long between two polls means the process itself was not running
    (stopped, or starved); waits and the no-progress watchdog do not count it, so a
    rank resumed after SIGSTOP does not blame itself (its peers have their own
    deadlines)."""
    return max(1.0, 20 * config.poll_s)


def _no_clock() -> int:
    """The CPU clock of a region that does not record it (``RunTimeline.cpu`` NaN)."""
    return 0


@dataclass(frozen=True)
class RegionResult:
    """timeline: per-task measured times; elapsed_s: wall time of the workers."""

    timeline: RunTimeline
    elapsed_s: float


class DaemonThread:
    """A persistent daemon thread running jobs from its queue with ``threads``
    torch intra-op threads."""

    def __init__(self, name: str, threads: int = 1):
        self.jobs: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, args=(threads,), name=name, daemon=True)
        self.thread.start()

    def _loop(self, threads: int) -> None:
        torch.set_num_threads(threads)
        while (job := self.jobs.get()) is not None:
            job()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the thread to end (after a ``None`` job); not from
        the thread itself (a collection that closes its session can run there)."""
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=timeout)


class _Run:
    """State shared by the workers of one region."""

    def __init__(self, program: RankProgram, calls: list[Callable[[], None]],
                 transport: Transport, config: ExecutorConfig):
        self.program, self.calls = program, calls
        self.transport, self.config = transport, config
        self.counters = transport.counters
        self.base = transport.base.tolist()
        self.states = [WorkerState(q.name, total=len(q.tasks)) for q in program.queues]
        self.records: list[list[tuple[int, int, int, int]]] = [[] for _ in program.queues]
        self.cause: str | None = None
        self._lock = threading.Lock()
        self._left = len(program.queues)
        self.finished = threading.Event()
        if not self._left:
            self.finished.set()

    def work(self, q: int) -> None:
        """Run queue ``q`` in order (the hot loop)."""
        st, rec = self.states[q], self.records[q]
        wait, need, base = self.program.wait, self.program.threshold, self.base
        words, signal, calls = self.counters.words, self.counters.signal, self.calls
        local, clock = self.program.local_signals, time.perf_counter_ns
        cpu = time.thread_time_ns if self.config.thread_cpu else _no_clock
        try:
            for i in self.program.queues[q].tasks:
                ev = wait[i]
                if ev >= 0 and (words[ev] - base[ev]) & MASK < need[ev]:
                    self.block(st, i, ev)
                st.running = i
                t0, c0 = clock(), cpu()
                calls[i]()
                rec.append((i, t0, clock(), cpu() - c0))  # ends before its signals can start a waiter
                for e in local[i]:  # wakes a waiter only at its threshold
                    signal(e, base[e], need[e])
                st.running, st.last_done = -1, i
                st.done += 1
        except BaseException as err:  # reported, never lost: the region fails with it
            self.fail(st, err)
        finally:
            del calls  # the region's buffers: nothing here holds them once the caller wakes
            st.finished = True
            self._worker_done()

    def block(self, st: WorkerState, task: int, ev: int) -> None:
        """Sleep until event ``ev`` reaches its threshold; raise ``Aborted`` or
        ``WaitTimeout`` (after ``deadline_s``)."""
        st.waiting, st.event = task, ev
        words, base, need = self.counters.words, self.base[ev], self.program.threshold[ev]
        start = seen = time.monotonic()
        limit = start + self.config.deadline_s
        while True:
            raw = words[ev]
            if (raw - base) & MASK >= need:
                break
            if self.transport.abort_reason() is not None:
                raise Aborted()
            now = time.monotonic()
            if now - seen > pause_s(self.config):  # stopped (SIGSTOP): not this wait's time
                limit += now - seen
            seen = now
            if now >= limit:
                raise WaitTimeout(task, ev, now - start)
            self.counters.sleep(ev, raw, min(self.config.poll_s, limit - now))
        st.waiting = st.event = -1

    def fail(self, st: WorkerState | None, err: BaseException) -> None:
        """Record the first cause and tell the peers; later failures only stop."""
        cause = None if isinstance(err, Aborted) else self._describe(st, err)
        if st is not None and st.running >= 0 and not isinstance(err, Aborted | WaitTimeout):
            st.failed = True
        with self._lock:
            if self.cause is None:
                self.cause = cause or self.transport.abort_reason() or "aborted"
        if cause is not None:
            self.transport.abort(f"rank {self.program.rank}: {cause}")

    def _describe(self, st: WorkerState | None, err: BaseException) -> str:
        g, name = self.program.graph, st.name if st is not None else "main"
        if isinstance(err, WaitTimeout):
            event = g.event_name(self.program.rank, err.event)
            return (f"{name} waited {err.waited_s:.3f} s (deadline) for {g.task(err.task)} "
                    f"on {event}")
        if isinstance(err, TimeoutError):
            return f"{name}: {err}"
        where = f" in {g.task(st.running)}" if st is not None and st.running >= 0 else ""
        return f"{name} failed{where}: {type(err).__name__}: {err}"

    def _worker_done(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.finished.set()

    def settle(self) -> None:
        """Wait until every event of the rank has its threshold's worth of signals,
        so no signal of this region can land after the next region's snapshot."""
        st = WorkerState("settle")
        words = self.counters.words
        for ev, need in enumerate(self.program.threshold):
            if (words[ev] - self.base[ev]) & MASK < need:
                self.block(st, -1, ev)

    def report(self, elapsed_s: float) -> HangReport:
        return HangReport(rank=self.program.rank, cause=self.cause or "aborted",
                          workers=tuple(self._worker_report(st) for st in self.states),
                          elapsed_s=elapsed_s)

    def _worker_report(self, st: WorkerState) -> WorkerReport:
        g, rank = self.program.graph, self.program.rank
        last = g.task(st.last_done) if st.last_done >= 0 else ""
        common = {"name": st.name, "last_done": last, "done": st.done, "total": st.total}
        if st.waiting >= 0 and st.event >= 0:
            raw = self.counters.words[st.event]
            return WorkerReport(status=WorkerStatus.WAITS, task=g.task(st.waiting),
                                event=g.event_name(rank, st.event),
                                progress=(raw - self.base[st.event]) & MASK,
                                threshold=self.program.threshold[st.event], raw=raw, **common)
        if st.running >= 0:
            status = WorkerStatus.FAILED if st.failed else WorkerStatus.RUNS
            return WorkerReport(status=status, task=g.task(st.running), **common)
        status = WorkerStatus.FINISHED if st.done == st.total else WorkerStatus.STOPPED
        return WorkerReport(status=status, **common)


class Executor:
    """Runs ``RankProgram``s of one rank on a pool of persistent worker threads."""

    def __init__(self, config: ExecutorConfig | None = None):
        self.config = config or ExecutorConfig()
        self._threads: list[DaemonThread] = []
        self._broken = False

    def run(self, program: RankProgram, region: Region, me: object, ctx: object,
            transport: Transport) -> RegionResult:
        """Run ``region``'s ``program``; ``me`` is this rank's buffer object (of the
        region's buffer type), ``ctx`` its read-only context.  Raises ``RegionError``
        on failure."""
        if self._broken:
            raise RuntimeError("executor has workers stuck in a failed region; make a new one")
        calls = task_calls(program, region.kernels, me, ctx, transport.put)
        run = _Run(program, calls, transport, self.config)
        while len(self._threads) < len(program.queues):
            name = f"hpmoe-worker-{len(self._threads)}"
            self._threads.append(DaemonThread(name, self.config.threads))
        with gc_paused(self.config.pause_gc):
            origin, start = time.perf_counter_ns(), time.monotonic()
            for q in range(len(program.queues)):
                self._threads[q].jobs.put(functools.partial(run.work, q))
            self._await(run)
            run.calls = []  # a gradient a queued job's run still referenced would be copied by autograd
            if run.cause is None:
                self._finish(run)
            elapsed = time.monotonic() - start
        if run.cause is not None:
            raise RegionError(run.report(elapsed))
        names = tuple(q.name for q in program.queues)
        timeline = timeline_from_records(program.rank, run.records, origin, names, self.config.thread_cpu)
        return RegionResult(timeline, elapsed)

    def _await(self, run: _Run) -> None:
        """Wait for the workers; fail the region when no task finishes for
        ``deadline_s``; give up on workers stuck inside kernels after a second one."""
        cfg = self.config
        last_done, last_t = -1, time.monotonic()
        seen = last_t
        while not run.finished.wait(cfg.poll_s):
            now, done = time.monotonic(), sum(st.done for st in run.states)
            if now - seen > pause_s(cfg):  # this process was stopped: that time is not the region's
                last_t += now - seen
            seen = now
            if done != last_done:
                last_done, last_t = done, now
            elif now - last_t > 2 * cfg.deadline_s:
                self._broken = True
                return
            elif now - last_t > cfg.deadline_s and run.cause is None:
                run.fail(None, TimeoutError(f"no task finished for {now - last_t:.3f} s (deadline)"))

    def _finish(self, run: _Run) -> None:
        try:
            run.transport.finish()
            run.settle()
        except BaseException as err:  # turned into the region's report
            run.fail(None, err)

    def close(self) -> None:
        """Stop the worker threads (idempotent; stuck ones are left to exit with
        the process: they are daemons)."""
        threads, self._threads = self._threads, []
        for t in threads:
            t.jobs.put(None)
        for t in threads:
            t.join(0.0 if self._broken else 1.0)

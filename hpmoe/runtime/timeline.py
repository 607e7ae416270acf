"""Measured timelines: when each task of a real region ran, on which worker."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RunTimeline:
    """One rank's region as it ran.

    task: [n] int64 task ids of the rank's graph; queue: [n] int32 index into
    ``queue_names`` (the rank's workers, matrix first); start, end: [n] float64
    seconds since ``origin_ns`` (``time.perf_counter_ns`` when the workers were
    started: CLOCK_MONOTONIC, comparable between processes of one host); cpu: [n]
    float64 seconds of its worker thread's CPU inside each task (``time.thread_time``:
    the kernel's own work, not the time the thread waited for a core or the host took;
    NaN unless ``ExecutorConfig.thread_cpu``).
    """

    rank: int
    origin_ns: int
    task: np.ndarray
    queue: np.ndarray
    start: np.ndarray
    end: np.ndarray
    queue_names: tuple[str, ...]
    cpu: np.ndarray

    @property
    def makespan(self) -> float:
        """Seconds from the first start to the last end (0 when empty)."""
        return float(self.end.max() - self.start.min()) if len(self.task) else 0.0

    def busy(self) -> np.ndarray:
        """[queues] float64 seconds each worker spent inside tasks."""
        return np.bincount(self.queue, weights=self.end - self.start, minlength=len(self.queue_names))


def timeline_from_records(rank: int, records: list[list[tuple[int, int, int, int]]], origin_ns: int,
                          queue_names: tuple[str, ...], thread_cpu: bool) -> RunTimeline:
    """Build a ``RunTimeline`` from per-queue (task, start_ns, end_ns, cpu_ns) records;
    without ``thread_cpu`` the CPU times were not read and are NaN."""
    rows = [(t, q, s, e, c) for q, rec in enumerate(records) for t, s, e, c in rec]
    arr = np.array(rows, np.int64).reshape(-1, 5)
    order = np.lexsort((arr[:, 0], arr[:, 2]))
    arr = arr[order]
    return RunTimeline(rank=rank, origin_ns=origin_ns, task=arr[:, 0].copy(),
                       queue=arr[:, 1].astype(np.int32), start=(arr[:, 2] - origin_ns) / 1e9,
                       end=(arr[:, 3] - origin_ns) / 1e9, queue_names=queue_names,
                       cpu=arr[:, 4] / 1e9 if thread_cpu else np.full(len(arr), np.nan))

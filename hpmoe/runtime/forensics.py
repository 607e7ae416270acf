"""What a failing region reports: per worker, what it waits on or runs, the
counter against its threshold, and the last task it finished."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class WorkerStatus(enum.Enum):
    """What a worker was doing when its rank stopped (the value is how reports say it)."""

    WAITS = "waits"
    RUNS = "runs"
    FAILED = "failed in"
    FINISHED = "finished"
    STOPPED = "stopped"


@dataclass
class WorkerState:
    """Live state of one worker thread (written by it, read on failure).

    waiting/event: task blocked and the event it waits on (-1: none);
    running: task inside its kernel (-1: none); last_done: last finished task;
    done/total: tasks finished / in the queue; finished: the queue is over;
    failed: the kernel of ``running`` raised."""

    name: str
    total: int = 0
    waiting: int = -1
    event: int = -1
    running: int = -1
    last_done: int = -1
    done: int = 0
    finished: bool = False
    failed: bool = False


@dataclass(frozen=True)
class WorkerReport:
    """A worker's state at the time of the failure, described for humans."""

    name: str
    status: WorkerStatus
    task: str = ""
    event: str = ""
    progress: int = -1  # increments of the event's counter in this region
    threshold: int = -1
    raw: int = 0  # raw counter value (base + progress, mod 2**32)
    last_done: str = ""
    done: int = 0
    total: int = 0

    def line(self) -> str:
        head = f"  {self.name}: {self.status.value}"
        if self.status is WorkerStatus.WAITS:
            head += (f" {self.task} on {self.event}: counter {self.progress} of threshold "
                     f"{self.threshold} (raw {self.raw})")
        elif self.status in (WorkerStatus.RUNS, WorkerStatus.FAILED):
            head += f" {self.task}"
        last = self.last_done or "none"
        return f"{head}; {self.done}/{self.total} tasks done, last finished: {last}"


@dataclass(frozen=True)
class HangReport:
    """Why rank ``rank`` stopped and what each of its workers was doing."""

    rank: int
    cause: str
    workers: tuple[WorkerReport, ...]
    elapsed_s: float

    def __str__(self) -> str:
        lines = [f"hpmoe runtime: rank {self.rank} stopped after {self.elapsed_s:.3f} s: {self.cause}"]
        return "\n".join(lines + [w.line() for w in self.workers])


class RegionError(RuntimeError):
    """A region that did not complete; ``report`` says who waited for what."""

    def __init__(self, report: HangReport):
        super().__init__(str(report))
        self.report = report


class WaitTimeout(Exception):
    """A wait passed its deadline (internal: turned into a ``RegionError``)."""

    def __init__(self, task: int, event: int, waited_s: float):
        super().__init__(f"task {task} waited {waited_s:.3f} s on event {event}")
        self.task, self.event, self.waited_s = task, event, waited_s


class Aborted(Exception):
    """The region was aborted by another worker or a peer (internal)."""

"""The multi-rank runtime: worker threads walking static queues, event counters,
one-sided puts over shared memory (``shm``) or torch.distributed (``dist``).

Entry points: ``Session`` (one per rank and EP group), ``ForwardRunner`` (the
forward Dispatch-to-Combine region), ``run_backward`` (its gradient), ``Executor``
(any ``Region``'s ``RankProgram``).
"""

from .backward import BackwardOutput, run_backward
from .executor import Executor, ExecutorConfig, RegionResult
from .faults import Fault, FaultKind
from .forensics import HangReport, RegionError, WorkerReport
from .forward import ForwardOptions, ForwardOutput, ForwardRunner, StepTimes
from .session import JOB_ENV, RuntimeConfig, Session
from .timeline import RunTimeline
from .transport.base import Step, Transport, TransportKind

__all__ = [
    "JOB_ENV", "BackwardOutput", "Executor", "ExecutorConfig", "Fault", "FaultKind", "ForwardOptions",
    "ForwardOutput", "ForwardRunner", "HangReport", "RegionError", "RegionResult", "RunTimeline",
    "RuntimeConfig", "Session", "Step", "StepTimes", "Transport", "TransportKind", "WorkerReport",
    "run_backward",
]

"""The multi-rank runtime: worker threads walking static queues, event counters,
one-sided puts over shared memory (``shm``) or torch.distributed (``dist``).

Entry points: ``Session`` (one per rank and EP group), ``ForwardRunner`` (the
forward Dispatch-to-Combine region), ``Executor`` (any ``Taskflow``).
"""

from ..exec.program import PeerView, PutSpec, RankProgram, Taskflow, compile_program, rank_subgraph
from .executor import Executor, ExecutorConfig, RegionResult
from .faults import Fault, FaultKind
from .forensics import HangReport, RegionError, WorkerReport
from .forward import FORWARD, ForwardOptions, ForwardOutput, ForwardRunner, StepTimes, make_schedule
from .session import JOB_ENV, RuntimeConfig, Session
from .timeline import RunTimeline
from .transport.base import Step, Transport, TransportKind

__all__ = [
    "FORWARD", "JOB_ENV", "Executor", "ExecutorConfig", "Fault", "FaultKind", "ForwardOptions",
    "ForwardOutput", "ForwardRunner", "HangReport", "PeerView", "PutSpec", "RankProgram",
    "RegionError", "RegionResult", "RunTimeline", "RuntimeConfig", "Session", "Step", "StepTimes",
    "Taskflow", "Transport", "TransportKind", "WorkerReport", "compile_program", "make_schedule",
    "rank_subgraph",
]

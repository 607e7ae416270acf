"""Static schedules: every task placed on one worker queue of its rank, in order.

``schedule(graph, policy, hardware)`` is the entry point; every policy returns a
``Schedule`` and every schedule can be checked with ``verify_schedule``.
"""

from __future__ import annotations

from collections.abc import Callable

from ..ir.graph import TaskGraph
from ..ir.schedule import QUEUE_POLICIES, Schedule, SchedulePolicy, WorkerCounts, schedule_from_assignment
from ..ir.schedule_verify import verify_schedule
from ..sim.hardware import HardwareModel
from .critical_path import Candidate, critical_path_candidates, critical_path_schedule
from .hyperparallel import hyperparallel_schedule, paper_tiles
from .serial import serial_schedule


def schedule(graph: TaskGraph, policy: SchedulePolicy, hardware: HardwareModel) -> Schedule:
    """Schedule every rank of ``graph`` on ``hardware``'s workers with ``policy``.

    SERIAL and HYPERPARALLEL read only the worker counts; CRITICAL_PATH uses the cost
    model and simulates its candidates."""
    if not isinstance(policy, SchedulePolicy):
        raise TypeError(f"policy must be a SchedulePolicy, got {policy!r}")
    if policy is SchedulePolicy.AUTO:
        raise ValueError("policy=AUTO chooses how a region runs (schedule.auto), not a queue order: "
                         f"pass one of {[p.value for p in QUEUE_POLICIES]}")
    return _SCHEDULERS[policy](graph, hardware)


_SCHEDULERS: dict[SchedulePolicy, Callable[[TaskGraph, HardwareModel], Schedule]] = {
    SchedulePolicy.SERIAL: lambda graph, hardware: serial_schedule(graph, hardware.workers),
    SchedulePolicy.HYPERPARALLEL: lambda graph, hardware: hyperparallel_schedule(graph, hardware.workers),
    SchedulePolicy.CRITICAL_PATH: critical_path_schedule,
}


__all__ = ["QUEUE_POLICIES", "Candidate", "Schedule", "SchedulePolicy", "WorkerCounts",
           "critical_path_candidates",
           "critical_path_schedule", "hyperparallel_schedule", "paper_tiles",
           "schedule", "schedule_from_assignment", "serial_schedule", "verify_schedule"]

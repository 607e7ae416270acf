"""Static schedules: every task placed on one worker queue of its rank, in order.

``schedule(graph, policy, hardware)`` is the entry point; every policy returns a
``Schedule`` and every schedule can be checked with ``verify_schedule``.
"""

from __future__ import annotations

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
    workers = hardware.workers
    if policy is SchedulePolicy.SERIAL:
        return serial_schedule(graph, workers)
    if policy is SchedulePolicy.HYPERPARALLEL:
        return hyperparallel_schedule(graph, workers)
    return critical_path_schedule(graph, hardware)


__all__ = ["QUEUE_POLICIES", "Candidate", "Schedule", "SchedulePolicy", "WorkerCounts",
           "critical_path_candidates",
           "critical_path_schedule", "hyperparallel_schedule", "paper_tiles",
           "schedule", "schedule_from_assignment", "serial_schedule", "verify_schedule"]

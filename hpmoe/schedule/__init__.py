"""Static schedules: every task placed on one worker queue of its rank, in order."""

from .base import Schedule, SchedulePolicy, WorkerCounts, schedule_from_assignment

__all__ = ["Schedule", "SchedulePolicy", "WorkerCounts", "schedule_from_assignment"]

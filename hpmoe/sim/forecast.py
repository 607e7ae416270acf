"""Forecasts of a whole region on a ``HardwareModel``, for ``SchedulePolicy.AUTO``.

- ``forecast_region``: a schedule's replay; on a model without ``host_cores``, no less
  than its busiest rank's work over the cores that rank owns.
- ``sequential_seconds``: a graph run task after task by one thread (the exact
  executor in one process): the sum of every task's work.
- ``kernel_by_kernel_tiles``: the tiling under which the task graph is the
  kernel-by-kernel path itself (whole-expert GEMMs, one vector tile per phase), so
  that path is forecast by the same cost model and simulator as every schedule.
- ``runtime_hardware``: the calibrated profile adapted to the multi-rank runtime.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from ..ir.graph import TaskGraph
from ..ir.schedule import Schedule, WorkerCounts
from ..routing import RoutingPlan
from ..spec import TileSpec
from .cost import TaskCosts, task_costs
from .hardware import HardwareModel, LinkEntry
from .simulate import SimResult, simulate


def cores_per_rank(ep: int) -> float:
    """Cores of this host each of ``ep`` local ranks gets (may be < 1)."""
    return len(os.sched_getaffinity(0)) / ep


def forecast_region(schedule: Schedule, hardware: HardwareModel, entry: np.ndarray | None = None,
                    costs: TaskCosts | None = None) -> tuple[float, SimResult]:
    """(seconds, replay) of a region: the simulator's makespan, or with ``entry`` ([ep]
    seconds at which each rank entered the region) the longest any rank spent in it (its
    last task's end less its entry); plus ``launch_overhead``.  With ``host_cores`` the
    replay shares the host's cores among every rank's workers; without, the replay's
    seconds are taken no less than the busiest rank's total work over the cores it owns.
    ``costs``: the tasks' costs (default ``task_costs(schedule.graph, hardware)``), e.g.
    measured ones, to replay a run's own kernel times."""
    costs = task_costs(schedule.graph, hardware) if costs is None else costs
    sim = simulate(schedule, hardware, costs=costs, entry=entry)
    g, seconds = schedule.graph, sim.makespan
    if entry is not None:
        last = np.zeros(g.ep)
        np.maximum.at(last, sim.timeline.rank, sim.timeline.end)
        seconds = float((last - entry).max())
    if hardware.host_cores <= 0:
        work = np.bincount(g.rank, weights=costs.work, minlength=g.ep)
        seconds = max(seconds, float(work.max(initial=0.0)) / max(1.0, cores_per_rank(g.ep)))
    return seconds + hardware.launch_overhead, sim


def replay_on_kernels(schedule: Schedule, hardware: HardwareModel, kernel_cpu: np.ndarray,
                      executor_overhead: float, entry: np.ndarray | None = None) -> float:
    """``forecast_region``'s seconds on a run's own kernels (a check of the model around
    them, not a forecast): each task's demand on its host's cores is its kernel's
    measured thread CPU seconds (``kernel_cpu`` [n]) plus the executor's CPU per task;
    its memory traffic is inside those times, so memory is not shared apart.  Links,
    waits, wake-ups, puts' host CPU and the launch stay ``hardware``'s."""
    graph = schedule.graph
    if len(kernel_cpu) != graph.num_tasks:
        raise ValueError(f"kernel_cpu must hold one time per task ({graph.num_tasks}), got {len(kernel_cpu)}")
    bad = np.flatnonzero(~(np.asarray(kernel_cpu) >= 0))
    if len(bad):
        raise ValueError(f"kernel_cpu[{bad[0]}] must be >= 0 seconds, got {float(kernel_cpu[bad[0]])}")
    hw = dataclasses.replace(hardware, shared_hbm=False)
    work = np.asarray(kernel_cpu, dtype=np.float64) + executor_overhead
    costs = dataclasses.replace(task_costs(graph, hw), work=work, floor=work)
    return forecast_region(schedule, hw, entry=entry, costs=costs)[0]


def sequential_seconds(graph: TaskGraph, hardware: HardwareModel) -> float:
    """Seconds for one thread to run every task of ``graph`` one after another."""
    return float(task_costs(graph, hardware).work.sum())


def kernel_by_kernel_tiles(plan: RoutingPlan) -> TileSpec:
    """Tiles as large as the region: one vector tile per phase and rank, one GEMM per
    expert and weight (the kernel-by-kernel path's kernels, as tasks)."""
    moe, tpr = plan.moe, plan.par.tokens_per_rank
    rows = max(1, tpr * moe.top_k, int(plan.recv_offsets[:, -1].max()))
    return TileSpec(rows=rows, gemm_rows=0, gemm_cols=max(2 * moe.ffn, moe.hidden, 2 * moe.shared_ffn, 1))


def core_share(share: float, ep: int, cores: float) -> float:
    """The fraction of its calibrated rate one core delivers while every core computes,
    from ``share``, what each of ``ep`` ranks got while all computed at once on
    ``cores`` cores: ranks beyond the cores time-share them, which the replay models.
    Above 1 when the host runs faster than when it was calibrated."""
    return share * max(1.0, ep / cores)


@dataclass(frozen=True)
class HostCosts:
    """What the runtime costs on a CPU host beyond its calibrated profile, measured per run.

    share: the fraction of the calibrated GEMM rate a rank gets while every rank computes.
    executor_overhead: seconds of the executor's own CPU per task.
    vector_slowdown: how much slower the vector kernels run while the matrix worker
      streams beside them.
    put_cpu: seconds of host CPU a remote put of the transport burns (``HardwareModel.put_cpu``).
    wake_latency: seconds from an event to the start of the task a sleeping worker waits
      for (``HardwareModel.wake_latency``).
    host_mem_bw: bytes/s the host's memory serves while every rank copies at once
      (``HardwareModel.host_mem_bw``; 0: not measured, each core streams alone).
    launch_overhead: seconds the executor spends on a region outside its workers
      (``HardwareModel.launch_overhead``).
    """

    share: float
    executor_overhead: float
    vector_slowdown: float = 1.0
    put_cpu: float = 0.0
    wake_latency: float = 0.0
    host_mem_bw: float = 0.0
    launch_overhead: float = 0.0

    def __post_init__(self) -> None:
        for name in ("share", "vector_slowdown"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HostCosts.{name} must be > 0, got {getattr(self, name)!r}")


def runtime_hardware(profile: HardwareModel, workers: WorkerCounts, link: tuple[float, float] | None,
                     host: HostCosts, ep: int) -> HardwareModel:
    """The cost model of the runtime: the ``cpu`` profile with the runtime's worker
    counts; the host's cores (``host_cores``: every rank's worker threads share them);
    compute rates scaled by ``core_share`` of ``host.share``, the vector rate also divided
    by ``host.vector_slowdown``; ``host.executor_overhead`` added to the per-task cost;
    ``host.put_cpu``, ``host.wake_latency``, ``host.host_mem_bw`` and
    ``host.launch_overhead`` as the model's own; and, when ``link`` is given as
    (bytes/s, latency s), that link instead of the profile's."""
    cores = float(len(os.sched_getaffinity(0)))
    share = core_share(host.share, ep, cores)
    hw = dataclasses.replace(
        profile, matrix_workers=workers.matrix, vector_workers=workers.vector, host_cores=cores,
        matrix_flops_bf16=profile.matrix_flops_bf16 * share,
        matrix_flops_fp32=profile.matrix_flops_fp32 * share,
        vector_flops=profile.vector_flops * share / host.vector_slowdown,
        task_overhead=profile.task_overhead + host.executor_overhead, put_cpu=host.put_cpu,
        wake_latency=host.wake_latency, host_mem_bw=host.host_mem_bw, launch_overhead=host.launch_overhead)
    if link is None:
        return hw
    bw, latency = link
    return dataclasses.replace(hw, link=(LinkEntry(max(ep, 1), bw, bw),), link_latency=latency,
                               notes=profile.notes + "; link measured over torch.distributed")

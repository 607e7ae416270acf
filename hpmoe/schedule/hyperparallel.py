"""The paper's policy: round-robin in topological order, staggered puts, no cost model.

HyperParallel-MoE (arXiv 2605.23764) builds its task list in topological order and
deals it round-robin over the cube workers (GEMMs) and the vector workers (puts,
SwiGLU) of each rank; puts are reordered so that rank r sends to destinations in the
order (r + i) mod EP, so that ranks do not all hit the same peer at once.  Its tiles:
GEMMs at (local expert x cube core) granularity, puts per (destination rank, expert,
128-token tile) — ``paper_tiles``.
"""

from __future__ import annotations

import numpy as np

from ..ir.analysis import task_levels
from ..ir.graph import IS_PUT, TaskGraph, Unit
from ..ir.schedule import Schedule, SchedulePolicy, WorkerCounts, schedule_from_assignment
from ..sim.hardware import HardwareModel
from ..spec import TileSpec

PAPER_TILE_ROWS = 128  # the paper's token tile of dispatch/combine puts and SwiGLU


def paper_tiles(hardware: HardwareModel) -> TileSpec:
    """The paper's tiling: one GEMM task per (expert, matrix core): one GEMM row block
    per expert (``gemm_rows=0``) and every GEMM's width split over the matrix workers."""
    return TileSpec(rows=PAPER_TILE_ROWS, gemm_rows=0, gemm_splits=hardware.matrix_workers)


def hyperparallel_schedule(graph: TaskGraph, workers: WorkerCounts) -> Schedule:
    """Deal every (rank, unit)'s tasks round-robin over its workers in topological
    order: completion level (the phase a generator emits tasks in), then local expert
    (the paper pipelines at expert granularity: all ranks send expert 0's rows first),
    then staggered destination for puts, then task id."""
    keys = (task_levels(graph), graph.expert.astype(np.int64), stagger(graph))
    worker, priority = deal_round_robin(graph, workers, keys)
    return schedule_from_assignment(graph, SchedulePolicy.HYPERPARALLEL, workers, worker, priority)


def stagger(graph: TaskGraph) -> np.ndarray:
    """[n] (peer - rank) mod EP for puts — rank r visits peers r, r+1, ... — else 0."""
    return np.where(IS_PUT[graph.kind], (graph.peer - graph.rank) % graph.ep, 0).astype(np.int64)


def deal_round_robin(graph: TaskGraph, workers: WorkerCounts, keys: tuple[np.ndarray, ...],
                     restart: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(worker, priority) dealing each (rank, unit)'s tasks, sorted by ``keys`` (most
    significant first, then task id), to workers 0, 1, 2, ... cyclically.  The deal
    starts again at worker 0 wherever ``restart`` (constant within each run of equal
    leading keys) changes value."""
    n = graph.num_tasks
    pool = graph.rank.astype(np.int64) * len(Unit) + graph.unit
    order = np.lexsort((np.arange(n), *reversed(keys), pool))
    group = pool if restart is None else pool * (int(restart.max(initial=0)) + 1) + restart
    g = group[order]
    idx = np.arange(n)
    first = np.ones(n, bool)
    first[1:] = g[1:] != g[:-1]
    k = idx - np.maximum.accumulate(np.where(first, idx, 0))
    width = np.where(graph.unit[order] == Unit.MATRIX, workers.matrix, workers.vector)
    worker = np.empty(n, np.int64)
    worker[order] = k % width
    priority = np.empty(n, np.int64)
    priority[order] = idx
    return worker, priority

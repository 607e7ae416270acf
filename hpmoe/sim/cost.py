"""Per-task durations of a ``TaskGraph`` on a ``HardwareModel`` (vectorised over all tasks).

Model, per task (seconds):

- compute: matrix tasks run a GEMM tile of m x n x k on one matrix worker, with
  m = rows, n = columns and k = flops / (2 m n), each padded up to the hardware's
  ``matrix_block`` (``HardwareModel.matrix_time``); vector tasks do ``flops`` at one
  vector worker's rate (``vector_time``).
- memory: ``bytes`` (read + written) at one worker's share of ``mem_bw``.  The share
  is ``mem_bw`` over the worker count *of the task's unit*: a unit whose workers all
  stream draws the whole bandwidth.  The two units are assumed not to contend for
  memory with each other (the GEMM operands that ``bytes`` counts again per column
  tile are mostly L2 hits), so the lower bounds carry no memory term.
- a task takes ``task_overhead + max(compute, memory)`` on its worker (roofline).
- puts: a put whose ``link_bytes`` is 0 stays on its rank and is a memory copy like
  any vector task.  A remote put costs ``task_overhead`` to issue, then occupies the
  link for ``link_bytes / bandwidth``, then ``link_latency`` passes before its signal
  lands: uncontended, ``overhead + link_latency + link_bytes / bandwidth``.  The
  bandwidth is the measured all-to-all figure for the graph's EP size and the put's
  direction (dispatch kinds vs combine kinds), per rank and direction.  Ports and
  their contention are the simulator's business; this module gives uncontended costs.
- link tiers: a put between ranks of different nodes (``ParallelSpec.nodes``) uses the
  inter-node tier (``inter_link_bw``, ``inter_latency``); within a node, the measured
  table at the node's size.  A port of either tier serves ``lanes`` puts at once, each
  at the port's bandwidth / lanes (``HardwareModel.stream_lanes``: one put stream
  moves at most ``stream_bw``), so ``transfer`` is one lane's time.
- ``floor``: what the worker needs whatever memory does (overhead + compute; remote
  puts: overhead).  The simulator charges memory separately on the rank's shared HBM;
  ``work`` (roofline with a per-worker share of ``mem_bw`` over the lowering's
  ``bytes``) is the estimate schedulers rank tasks by.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ir.graph import IS_PUT, TaskGraph, TaskKind, Unit
from .hardware import HardwareModel, LinkDirection

PUT_DIRECTION = {TaskKind.DISPATCH: LinkDirection.DISPATCH,
                 TaskKind.GRAD_DISPATCH: LinkDirection.DISPATCH,
                 TaskKind.COMBINE: LinkDirection.COMBINE,
                 TaskKind.GRAD_COMBINE: LinkDirection.COMBINE,
                 TaskKind.HOP_DISPATCH: LinkDirection.DISPATCH,
                 TaskKind.HOP_COMBINE: LinkDirection.COMBINE,
                 TaskKind.ROUTER_COMBINE: LinkDirection.COMBINE,
                 TaskKind.HOP_ROUTER_COMBINE: LinkDirection.COMBINE}
COMBINE_KINDS = np.array([PUT_DIRECTION.get(k) is LinkDirection.COMBINE for k in TaskKind])  # [kinds] bool


@dataclass(frozen=True)
class TaskCosts:
    """Uncontended costs of every task, seconds, arrays of shape [n] float64.

    work: time on the worker before any link transfer (every task), memory estimated.
    transfer: time a remote put occupies one lane of its source's egress and its peer's
      ingress port (0 for every other task).
    latency: time after the transfer until the put's signal lands (0 when no transfer).
    floor: time on the worker before any transfer with memory free (overhead + compute).
    tier: [n] int8, 1 where a put crosses nodes, else 0.
    lanes: puts each port serves at once, per tier (intra, inter).
    """

    work: np.ndarray
    transfer: np.ndarray
    latency: np.ndarray
    floor: np.ndarray
    tier: np.ndarray
    lanes: tuple[int, int] = (1, 1)

    @property
    def duration(self) -> np.ndarray:
        """[n] seconds from start to end of each task when nothing contends."""
        return self.work + self.transfer + self.latency


def task_costs(graph: TaskGraph, hardware: HardwareModel, dtype: torch.dtype | None = None) -> TaskCosts:
    """Costs of every task of ``graph`` on ``hardware``; GEMMs in ``dtype`` (default:
    the graph's dtype)."""
    dtype = graph.dtype if dtype is None else dtype
    compute = compute_time(graph, hardware, dtype)
    work = hardware.task_overhead + np.maximum(compute, memory_time(graph, hardware))
    remote = IS_PUT[graph.kind] & (graph.link_bytes > 0)
    tier = (remote & (put_tier(graph) > 0)).astype(np.int8)
    lanes = link_lanes(graph, hardware)
    transfer = np.where(remote, link_transfer_time(graph, hardware) * np.take(lanes, tier), 0.0)
    work = np.where(remote, hardware.task_overhead, work)
    floor = np.where(remote, hardware.task_overhead, hardware.task_overhead + compute)
    free = free_tasks(graph)
    work, floor = np.where(free, 0.0, work), np.where(free, 0.0, floor)
    latency = np.where(remote, np.where(tier > 0, hardware.inter_latency, hardware.link_latency), 0.0)
    return TaskCosts(work=work, transfer=transfer, latency=latency, floor=floor, tier=tier, lanes=lanes)


def free_tasks(graph: TaskGraph) -> np.ndarray:
    """[n] bool: tasks with no flops, no bytes and no link bytes, which cost nothing (as
    the paper's runtime turns empty tasks into no-ops; ``hpmoe.schedule.baseline`` empties
    the tasks a region leaves out or fuses elsewhere)."""
    return (graph.flops == 0) & (graph.bytes == 0) & (graph.link_bytes == 0)


def graph_nodes(graph: TaskGraph) -> int:
    """Nodes the graph's EP group spans (``ParallelSpec.nodes``, recorded by the lowering)."""
    return graph.nodes


def put_tier(graph: TaskGraph) -> np.ndarray:
    """[n] 1 where a task's rank and peer are in different nodes, else 0."""
    per = graph.ep // graph_nodes(graph)
    return (graph.rank // per != graph.peer // per).astype(np.int8)


def tier_link_bytes(graph: TaskGraph, kinds: tuple[TaskKind, ...] | None = None) -> np.ndarray:
    """[2, ep] link bytes each rank's puts (of ``kinds``; None: every task) send to ranks
    of its own node (row 0) and of other nodes (row 1)."""
    tier = put_tier(graph)
    mine = np.ones(graph.num_tasks, bool) if kinds is None else np.isin(graph.kind, [int(k) for k in kinds])
    return np.stack([np.bincount(graph.rank[mine & (tier == t)], weights=graph.link_bytes[mine & (tier == t)],
                                 minlength=graph.ep) for t in (0, 1)])


def tier_bandwidth(graph: TaskGraph, hardware: HardwareModel,
                   direction: LinkDirection) -> tuple[float, float]:
    """(intra-node, inter-node) port bandwidth, bytes/s, of ``graph``'s EP group."""
    nodes = graph_nodes(graph)
    if nodes > 1 and hardware.inter_link_bw <= 0:
        raise ValueError(f"the EP group spans {nodes} nodes but hardware {hardware.name!r} has "
                         "inter_link_bw=0 (no inter-node tier)")
    return hardware.link_bandwidth(graph.ep // nodes, direction), hardware.inter_link_bw


def link_lanes(graph: TaskGraph, hardware: HardwareModel) -> tuple[int, int]:
    """Puts a port serves at once per tier (see ``HardwareModel.stream_lanes``)."""
    intra, inter = tier_bandwidth(graph, hardware, LinkDirection.DISPATCH)
    return hardware.stream_lanes(intra), hardware.stream_lanes(inter) if inter > 0 else 1


def gemm_dims(graph: TaskGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(m, n, k) of every task's GEMM tile: rows, columns, and k = flops / (2 m n)
    (0 where m or n is 0).  Meaningful for matrix tasks only."""
    m = (graph.row1 - graph.row0).astype(np.float64)
    n = (graph.col1 - graph.col0).astype(np.float64)
    mn = m * n
    k = np.divide(graph.flops, 2.0 * mn, out=np.zeros_like(mn), where=mn > 0)
    return m, n, np.round(k)


def compute_time(graph: TaskGraph, hardware: HardwareModel, dtype: torch.dtype) -> np.ndarray:
    """[n] seconds of arithmetic: padded GEMM tiles on matrix workers, flops on vector workers."""
    m, n, k = gemm_dims(graph)
    matrix = hardware.matrix_time(m, n, k, dtype)
    vector = hardware.vector_time(graph.flops)
    return np.where(graph.unit == Unit.MATRIX, matrix, vector)


def memory_time(graph: TaskGraph, hardware: HardwareModel) -> np.ndarray:
    """[n] seconds to move each task's ``bytes`` (``kernel_bytes``) at its worker's share of
    ``mem_bw``; with ``host_cores`` each worker streams at one core's ``mem_bw``; matrix
    tasks none without ``hardware.matrix_memory``."""
    matrix = graph.unit == Unit.MATRIX
    sharers = np.where(matrix, hardware.matrix_workers, hardware.vector_workers)
    t = hardware.memory_time(kernel_bytes(graph, hardware), 1 if hardware.host_cores else sharers)
    return t if hardware.matrix_memory else np.where(matrix, 0.0, t)


def kernel_bytes(graph: TaskGraph, hardware: HardwareModel) -> np.ndarray:
    """[n] bytes each task's kernel moves: the lowering's ``bytes``, unpermute tiles times
    ``hardware.unpermute_traffic``."""
    return np.where(graph.kind == TaskKind.UNPERMUTE, graph.bytes * hardware.unpermute_traffic, graph.bytes)


def link_bandwidths(graph: TaskGraph, hardware: HardwareModel) -> np.ndarray:
    """[2, len(TaskKind)] bytes/s of the port each put kind uses, per tier (0: not a put)."""
    bw = np.zeros((2, len(TaskKind)))
    for kind, direction in PUT_DIRECTION.items():
        bw[:, kind] = tier_bandwidth(graph, hardware, direction)
    return bw


def link_transfer_time(graph: TaskGraph, hardware: HardwareModel) -> np.ndarray:
    """[n] seconds each task's ``link_bytes`` occupy a whole port (0 for non-puts)."""
    bw = link_bandwidths(graph, hardware)[put_tier(graph), graph.kind]
    return np.divide(graph.link_bytes, bw, out=np.zeros(graph.num_tasks), where=bw > 0)

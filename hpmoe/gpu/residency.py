"""Residency: how many programs of the persistent kernel can be on the GPU at once.

A persistent kernel whose programs wait on each other is deadlock-free only if every
program is resident: a program spinning on an event must not keep the program that
would signal it from being scheduled.  The schedule's deadlock proof
(``ir.schedule_verify``) assumes exactly that, so the backend sizes the schedule to the
resident count and refuses a program that needs more:

    resident = SMs x min(register limit, thread limit, shared-memory limit, block limit)

from the compiled kernel's registers per thread, warps and shared memory.  The EP ranks
share the device: each gets ``resident // ep`` workers, split between matrix and vector
units in proportion to each unit's total work under the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .core import HardwareModel, TaskGraph, Unit, WorkerCounts, task_costs


@dataclass(frozen=True)
class KernelResources:
    """What one program of a compiled kernel holds: registers per thread, bytes of
    local memory per thread (spills), shared memory bytes, warps."""

    registers: int
    spill_bytes: int
    shared_bytes: int
    num_warps: int


@dataclass(frozen=True)
class SMLimits:
    """Per-SM limits of a GPU (defaults: Hopper, CUDA occupancy tables) and its SM count."""

    sms: int
    registers: int = 65536
    shared_bytes: int = 228 * 1024
    threads: int = 2048
    programs: int = 32
    register_unit: int = 256  # registers are allocated per warp in units of 256

    @staticmethod
    def of(device: torch.device) -> SMLimits:
        p = torch.cuda.get_device_properties(device)
        hopper = SMLimits(sms=p.multi_processor_count)  # older torch builds lack some fields
        return SMLimits(sms=p.multi_processor_count,
                        registers=getattr(p, "regs_per_multiprocessor", hopper.registers),
                        shared_bytes=getattr(p, "shared_memory_per_multiprocessor", hopper.shared_bytes),
                        threads=getattr(p, "max_threads_per_multi_processor", hopper.threads))


H100 = SMLimits(sms=132)


def programs_per_sm(res: KernelResources, sm: SMLimits) -> int:
    """Programs of a kernel with resources ``res`` that fit one SM at once."""
    unit = sm.register_unit
    warp_regs = -(-res.registers * 32 // unit) * unit
    by_regs = sm.registers // max(warp_regs * res.num_warps, 1)
    by_threads = sm.threads // (32 * res.num_warps)
    by_shared = sm.shared_bytes // res.shared_bytes if res.shared_bytes else sm.programs
    return int(min(by_regs, by_threads, by_shared, sm.programs))


def resident_programs(res: KernelResources, sm: SMLimits) -> int:
    return sm.sms * programs_per_sm(res, sm)


def check_resident(queues: int, resident: int) -> None:
    """Refuse a program whose worker queues cannot all be resident at once."""
    if queues > resident:
        raise ValueError(f"the region needs {queues} resident programs (one per worker queue) but this "
                         f"kernel keeps at most {resident} resident: a waiting program could starve the one "
                         "it waits for.  Use fewer workers, or a kernel config with fewer registers/warps")


def split_workers(graph: TaskGraph, hardware: HardwareModel, per_rank: int) -> WorkerCounts:
    """``per_rank`` workers split between the units in proportion to their total work
    (cost model), at least one each."""
    if per_rank < 2:
        raise ValueError(f"per_rank={per_rank}: each rank needs at least one matrix and one vector worker")
    costs = task_costs(graph, hardware)
    busy = costs.work + costs.transfer
    matrix = float(busy[graph.unit == Unit.MATRIX].sum())
    vector = float(busy[graph.unit == Unit.VECTOR].sum())
    share = matrix / (matrix + vector) if matrix + vector > 0 else 0.5
    m = int(np.clip(round(per_rank * share), 1, per_rank - 1))
    return WorkerCounts(matrix=m, vector=per_rank - m)

"""Residency of the persistent kernel: occupancy arithmetic, the worker split, the refusal,
and a compile-only build for Hopper (sm_90) on this CPU."""

import dataclasses

import pytest
import torch

from hpmoe.gpu.residency import H100, KernelResources, check_resident, programs_per_sm, split_workers
from hpmoe.ir.graph import Unit
from hpmoe.regions.forward import lower_forward
from hpmoe.sim.cost import task_costs
from hpmoe.sim.presets import hardware_preset
from hpmoe.spec import TileSpec

from .helpers import tiny_plan


@pytest.mark.parametrize("regs,warps,shared,expected", [
    (255, 4, 8192, 2),  # 8192 registers per warp (255 x 32 rounded up to 256) x 4 warps = half an SM
    (128, 4, 0, 4),
    (64, 4, 0, 8),
    (32, 2, 0, 32),  # the block limit, not the registers (2 warps x 32 = 64 threads)
    (64, 4, 100 * 1024, 2),  # shared memory: 228 KB / 100 KB
    (32, 32, 0, 2),  # threads: 2048 / 1024
])
def test_programs_per_sm_take_the_tightest_limit(regs, warps, shared, expected):
    assert programs_per_sm(KernelResources(regs, 0, shared, warps), H100) == expected


def test_a_program_needing_more_workers_than_can_be_resident_is_refused():
    check_resident(264, 264)
    with pytest.raises(ValueError, match="265 resident programs.*at most 264"):
        check_resident(265, 264)


def test_the_worker_split_follows_the_cost_model():
    plan = tiny_plan(ep=2, tokens=64)
    g = lower_forward(plan, TileSpec(rows=16, gemm_rows=16, gemm_cols=16))
    hw = hardware_preset("h100")
    w = split_workers(g, hw, 66)
    assert w.per_rank == 66 and w.matrix >= 1 and w.vector >= 1
    c = task_costs(g, hw)
    busy = c.work + c.transfer
    share = busy[g.unit == Unit.MATRIX].sum() / busy.sum()
    assert abs(w.matrix / 66 - share) <= 1 / 66
    slow_gemm = dataclasses.replace(hw, matrix_flops_bf16=hw.matrix_flops_bf16 / 100,
                                    matrix_flops_fp32=hw.matrix_flops_fp32 / 100)
    assert split_workers(g, slow_gemm, 66).matrix > w.matrix
    with pytest.raises(ValueError, match="per_rank=1"):
        split_workers(g, hw, 1)


def test_the_persistent_kernel_compiles_for_hopper_with_wgmma_and_no_spills():
    pytest.importorskip("triton")
    from hpmoe.gpu.hopper import compile_hopper

    report = compile_hopper(torch.bfloat16).report
    print(report.line())
    assert report.wgmma, "the bf16 GEMM path must use warpgroup MMA on sm_90"
    assert 0 < report.registers <= 255 and report.spill_bytes == 0
    assert report.resident == H100.sms * report.programs_per_sm >= H100.sms

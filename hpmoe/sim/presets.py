"""The hardware presets: an Ascend A3 die, an H100 SXM, this project's nominal CPU, and
``cpu`` (the calibrated profile).  Every figure carries its source (``docs/hardware.md``)."""

from __future__ import annotations

from .hardware import HardwareModel, LinkEntry
from .profile import load_profile

_GB = 1e9
_US = 1e-6


def _ascend_a3() -> HardwareModel:
    """One Ascend A3 (910C-class) die as the paper's runtime drives it: 24 AIC + 24 AIV."""
    return HardwareModel(
        name="ascend-a3",
        matrix_workers=24,  # 24 AIC per die (paper; DESIGN.md §4)
        # 24, not the die's 48 AIV: the paper's runtime deals tasks to 24 vector workers.
        vector_workers=24,
        # cube 16x16x16 MAC/cycle x 2 FLOP x 1.85 GHz = 15.16 TFLOP/s (paper; DESIGN.md §4)
        matrix_flops_bf16=16 * 16 * 16 * 2 * 1.85e9,
        # ASSUMPTION: half the bf16 rate, from the fp32 cube fractal being 16x8 (32-byte rows)
        # instead of 16x16; no vendor fp32 cube figure was found.  Unverified.
        matrix_flops_fp32=16 * 16 * 8 * 2 * 1.85e9,
        matrix_block=16,  # cube fractal edge 16 (paper; DESIGN.md §4)
        # 256 B per vector repeat (Ascend CCE intrinsic docs) = 64 fp32 lanes; ASSUMPTION: one
        # repeat per cycle at the 1.85 GHz core clock -> 118.4 GFLOP/s per AIV.
        vector_flops=64 * 1.85e9,
        mem_bw=1.6e12,  # HBM 1.6 TB/s per die = 3.2 TB/s per 910C package / 2 (DESIGN.md §4)
        # measured all-to-all on A3, DeepEP port, 4096 tok, H 7168, top-8 (DESIGN.md §4)
        link=(LinkEntry(8, 146 * _GB, 125 * _GB), LinkEntry(16, 107 * _GB, 103 * _GB),
              LinkEntry(32, 102 * _GB, 95 * _GB), LinkEntry(64, 81 * _GB, 91 * _GB),
              LinkEntry(128, 57 * _GB, 81 * _GB)),
        # per-message fixed cost: issue (task_overhead) + 0.18 us = 1.18 us per put, FITTED to
        # DeepEP-Ascend's low-latency dispatch, EP8, 128 tokens: 132 us (docs/hardware.md)
        link_latency=0.18 * _US,
        task_overhead=1 * _US,  # per-task fixed cost "~us" (paper; DESIGN.md §4)
        l2_mb=192.0,  # L2 192 MB (DESIGN.md §4)
        # ASSUMPTION (no published A3 GEMM efficiency): 0.7 of peak, between DeepGEMM's grouped
        # GEMM on H800 (0.55-0.65 of peak) and dense bf16 8192^3 on H100 (0.81); tiles narrower
        # than the 128 x 256 base block the paper's GMM deals (128) lose in proportion.
        matrix_efficiency=0.7, matrix_full_edge=128,
        # ASSUMPTION: the EP8 all-to-all rate needs all 24 vector workers: 146 / 24 GB/s per put stream
        stream_bw=146 * _GB / 24,
        notes="one A3 die; fp32 cube rate, AIV rate, GEMM efficiency and the per-stream put rate are "
              "assumptions; the per-message cost is fitted",
    )


def _h100() -> HardwareModel:
    """H100 SXM with its 132 SMs split DeepSeek-V3-style: 112 GEMM SMs + 20 comm/vector SMs."""
    return HardwareModel(
        name="h100",
        # 132 SMs (NVIDIA; DESIGN.md §4); 20 SMs for all-to-all as in the DeepSeek-V3 report
        # (DeepEP's V1 example uses 24); the remaining 112 run GEMMs.
        matrix_workers=112,
        vector_workers=20,
        matrix_flops_bf16=989e12 / 132,  # 989 TFLOP/s dense bf16 over 132 SMs (NVIDIA; DESIGN.md §4)
        # 67 TFLOP/s FP32 (NVIDIA H100 SXM datasheet) / 132: torch leaves TF32 off for matmul
        matrix_flops_fp32=67e12 / 132,
        matrix_block=16,  # ASSUMPTION: mma m16n8k16 bf16 instruction edge; 128-row tiles align anyway
        # 128 FP32 lanes x 1.98 GHz boost, one non-FMA op per lane per cycle (NVIDIA: 67 TFLOP/s
        # FP32 counts FMA as 2) -> 253 GFLOP/s per SM
        vector_flops=128 * 1.98e9,
        mem_bw=3.35e12,  # HBM3 3.35 TB/s (NVIDIA; DESIGN.md §4)
        # DeepEP V1 normal kernels (docs/legacy.md), H800 + CX7 400 Gb/s IB, 4096 tok, H 7168,
        # top-8: EP8 NVLink 153/158, EP16-64 RDMA 43/43, 58/57, 51/50 GB/s (DESIGN.md §4)
        link=(LinkEntry(8, 153 * _GB, 158 * _GB), LinkEntry(16, 43 * _GB, 43 * _GB),
              LinkEntry(32, 58 * _GB, 57 * _GB), LinkEntry(64, 51 * _GB, 50 * _GB)),
        link_latency=2 * _US,  # ASSUMPTION: one NVSHMEM-style put + signal, ~2 us
        task_overhead=1 * _US,  # ASSUMPTION: same order as the paper's per-task cost
        l2_mb=50.0,  # 50 MB L2 (NVIDIA H100 SXM; DESIGN.md §6)
        # DeepGEMM grouped GEMM, H800: 1288 TFLOPS on 8 x 4096 x 4096 x 7168 = 0.65 of the 1979
        # FP8 peak (DESIGN.md §6), applied to bf16; DeepGEMM's BLOCK_M is 128
        matrix_efficiency=0.65, matrix_full_edge=128,
        # DeepEP normal kernels reach 153 GB/s NVLink with 24 SMs: 153 / 24 GB/s per SM stream
        stream_bw=153 * _GB / 24,
        # 400 Gb/s CX7 per GPU, DeepEP measured 43-58 GB/s RDMA (DESIGN.md §4): 50 GB/s
        inter_link_bw=50 * _GB, inter_latency=2 * _US,  # ASSUMPTION: RDMA put + signal ~2 us
        notes="H100 SXM, 112 GEMM + 20 comm SMs; link figures measured on H800 by DeepEP",
    )


def cpu_nominal(matrix_workers: int = 1, vector_workers: int = 1) -> HardwareModel:
    """This project's reference CPU before calibration, with the given worker threads.

    Rates are single-thread GEMM figures measured on a Xeon with AMX (DESIGN.md §5: 290
    GFLOP/s bf16, 87 fp32) and its loopback all-to-all (0.6 GB/s per rank); the rest
    are ASSUMPTIONS of the right order.  Enough to count workers and to rank schedules;
    ``hpmoe calibrate`` measures the machine at hand."""
    return HardwareModel(
        name="cpu-nominal", matrix_workers=matrix_workers, vector_workers=vector_workers,
        matrix_flops_bf16=290e9, matrix_flops_fp32=87e9, matrix_block=1,
        vector_flops=2e9,  # ASSUMPTION: one core's elementwise torch ops
        mem_bw=10 * _GB,  # ASSUMPTION: one core's streaming copy
        link=(LinkEntry(2, 0.6 * _GB, 0.6 * _GB),),
        link_latency=20 * _US,  # ASSUMPTION: a futex wake plus a small copy
        task_overhead=20 * _US,  # ASSUMPTION: one Python task dispatch
        notes="uncalibrated: GEMM and link rates from DESIGN.md §5, the rest assumed")


_PRESETS = {"ascend-a3": _ascend_a3, "h100": _h100, "cpu": load_profile}
HARDWARE_PRESETS = tuple(_PRESETS)


def hardware_preset(name: str) -> HardwareModel:
    """The named hardware model: ``ascend-a3``, ``h100`` or ``cpu`` (the calibrated profile
    at ``default_profile_path()``; FileNotFoundError telling to run ``hpmoe calibrate``)."""
    if name not in _PRESETS:
        raise ValueError(f"hardware preset={name!r} is not one of {list(HARDWARE_PRESETS)}")
    return _PRESETS[name]()

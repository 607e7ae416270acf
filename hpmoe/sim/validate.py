"""The hardware models against published measurements they were not given.

Each ``Check`` is one published figure, what the model predicts for it with the same
rules the simulator applies, and which model input (if any) was fitted to which
source, so that a circular row says so.  ``benchmarks/validate_model.py`` prints the
table that docs/hardware.md shows.

Rules used (as in ``hpmoe.sim.cost`` and ``hpmoe.sim.simulate``):
- a GEMM that fills every matrix worker with tiles of at least ``matrix_full_edge``
  runs at ``matrix_efficiency`` of peak unless its compulsory HBM bytes take longer;
- an all-to-all moves its payload through a port at the link table's bandwidth; each
  message also costs its issuing worker ``task_overhead`` + ``link_latency``, and each
  of the ``vector_workers`` issues its share of the messages one after another, at one
  lane (``stream_bw``) each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import HardwareModel, LinkDirection
from .presets import hardware_preset

_US = 1e-6


@dataclass(frozen=True)
class Check:
    """One published measurement and the model's prediction (same unit)."""

    name: str
    source: str
    unit: str
    measured: float
    predicted: float
    fitted: str  # which model input was fitted to which measurement; "" when none

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted / self.measured - 1.0

    @property
    def circular(self) -> bool:
        return bool(self.fitted)


def grouped_gemm_tflops(hw: HardwareModel, groups: int, m: int, n: int, k: int, elem_bytes: int,
                        peak_scale: float = 1.0) -> float:
    """TFLOP/s of a grouped GEMM (``groups`` x [m, k] @ [k, n]) on the whole device:
    compute at the tile efficiency of 128 x 128 tiles and ``peak_scale`` times the bf16
    peak (2 for FP8), or the inputs, weights and bf16 output over ``mem_bw``."""
    flops = 2.0 * groups * m * n * k
    rate = hw.matrix_workers * hw.matrix_flops_bf16 * peak_scale * float(hw.tile_efficiency(128, 128))
    nbytes = groups * ((m * k + k * n) * elem_bytes + m * n * 2)
    return flops / max(flops / rate, nbytes / hw.mem_bw) / 1e12


def alltoall_us(hw: HardwareModel, ep: int, tokens: int, hidden: int, copies: float, elem_bytes: int,
                direction: LinkDirection) -> float:
    """µs of one dispatch or combine of ``tokens`` per rank, each sent ``copies`` times
    (top-k without deduplication, ranks per token with it), ``elem_bytes`` per element."""
    messages = tokens * copies * (ep - 1) / ep
    size = hidden * elem_bytes
    bw = hw.link_bandwidth(ep, direction)
    lane = size * hw.stream_lanes(bw) / bw
    per_worker = messages / hw.vector_workers * (hw.task_overhead + lane + hw.link_latency)
    return max(messages * size / bw, per_worker) / _US


def checks() -> list[Check]:
    """Every published figure of DESIGN.md §4/§6 the models can predict."""
    a3, h100 = hardware_preset("ascend-a3"), hardware_preset("h100")
    gpu = replace(h100, matrix_workers=132)  # a GEMM alone uses every SM
    # H800: same SMs and HBM as H100 SXM, NVLink capped at ~160 GB/s; FP8 at twice bf16
    out = [Check("DeepGEMM grouped GEMM 8x4096x4096x7168, FP8, H800", "DeepGEMM README", "TFLOP/s",
                 1288.0, grouped_gemm_tflops(gpu, 8, 4096, 4096, 7168, 1, 2.0),
                 "h100 matrix_efficiency = 1288 / 1979 (this row)"),
           Check("DeepGEMM grouped GEMM 8x4096x7168x2048, FP8, H800", "DeepGEMM README", "TFLOP/s",
                 1093.0, grouped_gemm_tflops(gpu, 8, 4096, 7168, 2048, 1, 2.0), "")]
    for ep, bw in ((16, 43.0), (32, 58.0), (64, 51.0)):
        out.append(Check(f"DeepEP normal dispatch EP{ep}, RDMA bottleneck GB/s, H800", "DeepEP README",
                         "GB/s", bw, h100.inter_link_bw / 1e9, ""))
    ll = {8: (132.0, 126.0), 16: (139.0, 135.0), 32: (153.0, 151.0)}
    for ep, (disp, comb) in ll.items():
        for name, measured, direction, elem in (("dispatch", disp, LinkDirection.DISPATCH, 2),
                                                ("combine", comb, LinkDirection.COMBINE, 2)):
            out.append(Check(f"DeepEP-Ascend low-latency {name} EP{ep}, 128 tokens, bf16",
                             "DeepEP-Ascend README", "us", measured,
                             alltoall_us(a3, ep, 128, 7168, 8, elem, direction),
                             "ascend-a3 link_latency: task_overhead + link_latency = 1.18 us per "
                             "message, fitted to this row" if (ep, name) == (8, "dispatch") else ""))
    return out

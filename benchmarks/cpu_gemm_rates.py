"""One-thread fp32 and bf16 GEMM rates of this CPU as torch runs them: whether bf16 is
native here or emulated (about 60x slower than fp32 with AVX2 only).  Environment
variables that cap torch's instruction set (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``) apply, so a capped run shows what an
AVX2 machine would compute with.

    .venv/bin/python benchmarks/cpu_gemm_rates.py [--size 512] [--reps 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from hpmoe.machine import record


def gflops(dtype: torch.dtype, size: int, reps: int) -> float:
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=g).to(dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * size ** 3 * reps / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    record()
    torch.set_num_threads(1)
    for dtype in (torch.float32, torch.bfloat16):
        print(f"{str(dtype).removeprefix('torch.'):>9}: {gflops(dtype, a.size, a.reps):7.1f} GFLOP/s "
              f"({a.size}^3, one thread)")


if __name__ == "__main__":
    main()

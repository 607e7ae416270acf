"""GEMM tiles as the runtime's GEMM_UP kernel runs them (x[128, K] @ w[e, cols].T, bf16, one
thread), with the weight tile hot (the same one every call) and cold (cycling through 48
experts x 3 column tiles, about 300 MB at K = 2048), alone and as two processes at once:
whether two ranks on two cores slow each other's GEMMs.  Prints GFLOP/s (median of 5 batches).

    .venv/bin/python benchmarks/gemm_pair.py [--k 2048]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from hpmoe.machine import record

N, EXPERTS = 512, 48


def gflops(k: int, call: Callable[[int], object], n: int = 40) -> float:
    for i in range(3):
        call(i)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            call(i)
        samples.append((time.perf_counter() - t0) / n)
    return 2 * 128 * N * k / statistics.median(samples) / 1e9


def one(k: int, name: str) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, k, generator=g).bfloat16()
    w = torch.randn(EXPERTS, 3 * N, k, generator=g).bfloat16()
    out = torch.empty(128, N, dtype=torch.bfloat16)
    hot = gflops(k, lambda i: torch.mm(x, w[0, :N].t(), out=out))

    def cold_tile(i: int) -> torch.Tensor:
        c = i // EXPERTS % 3
        return w[i % EXPERTS, c * N:(c + 1) * N]

    cold = gflops(k, lambda i: torch.mm(x, cold_tile(i).t(), out=out))
    print(f"{name}: K {k}, hot {hot:.0f}, cold {cold:.0f} GFLOP/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--as", dest="name", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    record()
    if args.name:
        one(args.k, args.name)
        return
    me = [sys.executable, __file__, "--k", str(args.k), "--as"]
    subprocess.run([*me, "alone"], check=True)
    pair = [subprocess.Popen([*me, f"pair {j}"]) for j in (0, 1)]
    if any(p.wait() for p in pair):
        sys.exit(1)


if __name__ == "__main__":
    main()

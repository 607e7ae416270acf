"""A calibrated profile's GEMM rates, shape against shape, checked now: the calibration's
``KernelGemm`` tiles (bf16, one thread, weights from memory) at the given M x 512 x K
shapes, timed in rounds as calibration times them (``hpmoe.sim.calibrate``), each
shape's rate now over the profile's rate for it, divided by the same ratio at the first
shape (the share probe's 128 x 512 x 512 by default).  1.00: the profile has that shape
right relative to the first; 0.90: the shape runs 10% slower than the profile says once
the first is matched, as the bench matches it with its share.

    .venv/bin/python benchmarks/profile_shapes.py [--profile PATH] [--repeat 3]
        [--shapes 128x512 128x256 128x2048 96x1408 96x2048 64x768 64x2048]
"""

from __future__ import annotations

import argparse

import torch

from hpmoe.machine import record
from hpmoe.sim.calibrate import WEIGHT_BYTES, KernelGemm, _gemm_bench, _round_medians
from hpmoe.sim.profile import default_profile_path, load_profile

SHAPES = ("128x512", "128x256", "128x2048", "96x1408", "96x2048", "64x768", "64x2048")


def relative_rates(profile_path: str, shapes: list[tuple[int, int]], rounds: int) -> list[float]:
    """Each shape's measured rate over the profile's, over the same ratio at ``shapes[0]``."""
    profile = load_profile(profile_path)
    gen = torch.Generator().manual_seed(0)
    tiles = [KernelGemm(m, k, torch.bfloat16, WEIGHT_BYTES, gen) for m, k in shapes]
    seconds = _round_medians([_gemm_bench(tile) for tile in tiles], rounds)
    ratios = [float(profile.matrix_time(m, 512, k, torch.bfloat16))
              / tile.compute_seconds(s, profile.task_overhead)
              for (m, k), tile, s in zip(shapes, tiles, seconds, strict=True)]
    return [r / ratios[0] for r in ratios]


def shape(text: str) -> tuple[int, int]:
    """``MxK`` (e.g. ``128x512``) as (M, K), both positive."""
    parts = text.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--shapes takes MxK with positive M and K, got {text!r}")
    return int(parts[0]), int(parts[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="profile path (default: the saved cpu profile)")
    ap.add_argument("--shapes", nargs="+", type=shape, default=[shape(s) for s in SHAPES],
                    help="MxK tiles; the first is the reference")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeat", type=int, default=3, help="measurements, one line each")
    args = ap.parse_args()
    record()
    torch.set_num_threads(1)
    path = args.profile or str(default_profile_path())
    for _ in range(args.repeat):
        rel = relative_rates(path, args.shapes, args.rounds)
        line = " ".join(f"{m}x512x{k}: {r:.3f}" for (m, k), r in zip(args.shapes, rel, strict=True))
        print(line, flush=True)


if __name__ == "__main__":
    main()

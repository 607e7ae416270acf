"""Runtime figures for docs/PERFORMANCE-runtime.md.  Timings are noisy while other
work runs on the machine: take final figures on a quiet one, and rerun freely.

Per-task overhead of the executor (empty tasks, one process, no communication, wall
time per task; and "loaded", the CPU per task outside the kernels with both workers busy;
the shapes are described in hpmoe/bench/overhead.py):

    .venv/bin/python benchmarks/bench_runtime.py overhead [--tasks 4000] [--repeats 5]

Speedup over the serialized baseline and the cost model's prediction, ``--repeat``
`hpmoe bench --predict` runs per configuration (a markdown table, one row per run and a
summary row with the median and the range of ``speedup`` over the runs: the run-to-run
noise; JSON with --out):

    .venv/bin/python benchmarks/bench_runtime.py configs [--ep 2] [--iters 10] [--warmup 5]
        [--repeat 3] [--only NAME ...] [--out F] [--extra MORE BENCH ARGS]

The CPU model's forecast of the runtime region against the measured region on
compute-bound configurations (shared-memory transport, hyperparallel schedule), each
configuration ``--repeats`` runs of `hpmoe bench --predict` (each run's region is the
median of its iterations, slowest rank); the table gives the median over runs and the
range of the error, with the host's speed (``cpu_share_during``) measured between the timed
iterations and, next to it, measured before them (what AUTO decides with):

    .venv/bin/python benchmarks/bench_runtime.py predict [--repeats 3] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from hpmoe.bench.overhead import EmptyShape, loaded_cost, seconds_per_task
from hpmoe.machine import record


def overhead(args: argparse.Namespace) -> None:
    print(f"{'case':>12} {'tasks':>6} {'us/task':>8}")
    for shape in EmptyShape:
        s = seconds_per_task(args.tasks, shape, args.repeats)
        print(f"{shape.value:>12} {args.tasks:>6} {s * 1e6:>8.2f}")
    loaded = loaded_cost(repeats=args.repeats)
    print(f"{'loaded':>12} {600:>6} {loaded.outside_s * 1e6:>8.2f}  (CPU outside the kernels, GEMM + SwiGLU "
          f"tiles; the SwiGLU tile ran {loaded.vector_slowdown:.2f}x its CPU alone)")


SMALL = ["--preset", "small", "--tokens", "1024"]
CONFIGS = {
    # the tiny layer: nothing to overlap, per-step overheads dominate
    "tiny-shm": ["--preset", "tiny", "--transport", "shm"],
    "tiny-dist": ["--preset", "tiny", "--transport", "dist"],
    # compute-bound: puts are shared-memory copies / loopback TCP, small next to the GEMMs
    "compute-shm": [*SMALL, "--transport", "shm"],
    "compute-dist": [*SMALL, "--transport", "dist"],
    "compute-link-4gbit": [*SMALL, "--link", "4gbit"],
    # communication-bound: the same layer, ranks behind slower shaped links
    "comm-link-1gbit": [*SMALL, "--link", "1gbit"],
    "comm-link-500mbit": [*SMALL, "--link", "500mbit"],
}
# compute-bound: larger hidden and FFN sizes, more tokens per rank (two ranks, shared memory)
PREDICT_CONFIGS = {
    "small-1024": ["--preset", "small", "--tokens", "1024"],
    "small-4096": ["--preset", "small", "--tokens", "4096"],
    "qwen3-30b-a3b-512": ["--preset", "qwen3-30b-a3b", "--tokens", "512"],
    "deepseek-v2-lite-512": ["--preset", "deepseek-v2-lite", "--tokens", "512"],
}
COLUMNS = ("auto_chosen", "auto_reason", "schedule", "serial_ms", "kernel_by_kernel_ms",
           "serial_same_transport_ms", "runtime_taskflow_ms", "taskflow_ms", "speedup",
           "kernel_by_kernel_speedup", "runtime_speedup", "predicted_taskflow_ms",
           "measured_taskflow_region_ms", "prediction_error_taskflow", "prediction_error_serial_schedule",
           "host_steal_fraction")


def bench_runs(name: str, argv: list[str], repeats: int) -> list[dict]:
    """The JSON reports of ``repeats`` runs of the ``hpmoe bench`` command ``argv``; a
    failed run prints a row naming ``name`` and its last error line, and ends the series."""
    runs = []
    for _ in range(repeats):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
        if proc.returncode:
            print(f"| {name} | failed: {proc.stderr.strip().splitlines()[-1:]} |", flush=True)
            break
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return runs


def configs(args: argparse.Namespace) -> None:
    rows = {}
    print("| config | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for name, extra in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        argv = [sys.executable, "-m", "hpmoe", "bench", "--ep", str(args.ep), "--json", "--predict",
                "--iters", str(args.iters), "--warmup", str(args.warmup), *extra, *args.extra]
        runs = bench_runs(name, argv, args.repeat)
        for run in runs:
            print(f"| {name} | " + " | ".join(str(run.get(c)) for c in COLUMNS) + " |", flush=True)
        if runs:
            rows[name] = runs
            speedups = sorted(r["speedup"] for r in runs)
            print(f"| {name} (median of {len(runs)}, range) | speedup {statistics.median(speedups):.3f} "
                  f"[{speedups[0]:.3f}, {speedups[-1]:.3f}] |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def predict(args: argparse.Namespace) -> None:
    print("| config | predicted ms | measured ms | error | error range over runs | runs within 15% "
          "| share during | share before | error with the share before (range) | steal (range) "
          "| replay on its kernels: error (range) |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---|---|---|")
    rows = {}
    for name, extra in PREDICT_CONFIGS.items():
        if args.only and name not in args.only:
            continue
        argv = [sys.executable, "-m", "hpmoe", "bench", "--ep", "2", "--json", "--predict",
                "--transport", "shm", "--schedule", "hyperparallel", "--iters", str(args.iters),
                "--warmup", str(args.warmup), *extra]
        runs = bench_runs(name, argv, args.repeats)
        if not runs:
            continue
        rows[name] = runs
        pred, meas = _med(runs, "predicted_taskflow_ms"), _med(runs, "measured_taskflow_region_ms")
        inside = sum(abs(r["prediction_error_taskflow"]) <= 0.15 for r in runs)
        print(f"| {name} | {pred:.1f} | {meas:.1f} | {pred / meas - 1:+.0%} | "
              f"{_range(runs, 'prediction_error_taskflow')} | {inside} of {len(runs)} | "
              f"{_med(runs, 'cpu_share_during'):.2f} | {_med(runs, 'cpu_share'):.2f} | "
              f"{_error(runs, 'predicted_taskflow_pre_ms')} "
              f"({_range(runs, 'prediction_error_taskflow_pre')}) | {_steal(runs)} | "
              f"{_error(runs, 'replayed_taskflow_on_measured_kernels_ms')} "
              f"({_range(runs, 'replay_error_taskflow_on_measured_kernels')}) |",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def _steal(runs: list[dict]) -> str:
    """The runs' ``host_steal_fraction`` as a percent range ("-" where none was read)."""
    steal = sorted(r["host_steal_fraction"] for r in runs if "host_steal_fraction" in r)
    return f"{steal[0]:.1%} to {steal[-1]:.1%}" if steal else "-"


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _error(runs: list[dict], predicted: str) -> str:
    """The error of the median forecast against the median measured region."""
    return f"{_med(runs, predicted) / _med(runs, 'measured_taskflow_region_ms') - 1:+.0%}"


def _range(runs: list[dict], key: str) -> str:
    errs = [r[key] for r in runs]
    return f"{min(errs):+.0%} to {max(errs):+.0%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--tasks", type=int, default=4000)
    o.add_argument("--repeats", type=int, default=5)
    c = sub.add_parser("configs")
    c.add_argument("--ep", type=int, default=2)
    c.add_argument("--iters", type=int, default=10)
    c.add_argument("--warmup", type=int, default=5)
    c.add_argument("--repeat", type=int, default=3, help="runs per configuration (the noise)")
    c.add_argument("--only", nargs="*", default=[])
    c.add_argument("--out", default=None)
    c.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `hpmoe bench` args")
    p = sub.add_parser("predict")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--only", nargs="*", default=[])
    p.add_argument("--out", default=None)
    args = ap.parse_args()
    record()
    {"overhead": overhead, "configs": configs, "predict": predict}[args.what](args)


if __name__ == "__main__":
    main()

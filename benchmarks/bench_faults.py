"""Time to diagnosis of each failure the runtime must report (docs/lab/2026-measurements.md).

    flock /tmp/hpmoe-bench.lock python benchmarks/bench_faults.py   # from the repository root

Per case: the seconds from the start of the failing region (or from the signal) until
each rank has its diagnosis, the job's wall time, and what was left behind.  Ranks run
``tests/fault_rank.py`` (deadline 2 s) or ``hpmoe bench`` on the tiny preset.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpmoe.launch.launcher import LaunchSpec, launch, left_by, sweep_stale_all
from hpmoe.machine import record
from hpmoe.runtime.transport.heap import HeapNeed, SymmetricHeap
from hpmoe.runtime.transport.segment import SHM_DIR, create_segment, new_token, segment_name, sweep

TINY = ["--preset", "tiny", "--tokens", "32", "--tile-rows", "8", "--gemm-rows", "8", "--gemm-cols", "16",
        "--warmup", "1", "--schedule", "hyperparallel", "--deadline", "5"]
ROOT = os.geteuid() == 0 and shutil.which("tc") is not None


def diagnoses(stderr: str) -> dict[str, float]:
    """case -> seconds of every ``CASE: diagnosed after T s:`` line."""
    out = {}
    for line in stderr.splitlines():
        if ": diagnosed after " in line:
            case, rest = line.split(": diagnosed after ", 1)
            out[case] = float(rest.split(" s: ", 1)[0])
    return out


def rank_cases(case: str, transport: str, prefix: list[str] | None = None) -> None:
    argv = (sys.executable, "-m", "tests.fault_rank", case, transport)
    start = time.monotonic()
    if prefix:  # in a mount namespace: the launcher is the command inside it
        code = ("import sys; from hpmoe.launch.launcher import LaunchSpec, launch; "
                "r = launch(LaunchSpec(argv=tuple(sys.argv[1:]), world=2, capture=True, grace_s=1.0)); "
                "print(chr(0).join(x.stderr for x in r.ranks), file=sys.stderr)")
        proc = subprocess.run([*prefix, sys.executable, "-c", code, *argv], capture_output=True, text=True)
        per_rank = [diagnoses(chunk) for chunk in proc.stderr.split("\0")]
        wall = time.monotonic() - start
    else:
        result = launch(LaunchSpec(argv=argv, world=2, capture=True, timeout_s=60.0, grace_s=1.0))
        wall = result.elapsed_s
        per_rank = [diagnoses(r.stderr) for r in result.ranks]
    cases = sorted({c for d in per_rank for c in d})
    for c in cases:
        times = [d[c] for d in per_rank if c in d]
        print(f"{case}/{c:8s} {transport:5s} ranks diagnosed: {len(times)}, slowest {max(times):.3f} s, "
              f"job wall {wall:.2f} s", flush=True)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def signalled_launcher(sig: int, link: str | None) -> None:
    argv = [sys.executable, "-m", "hpmoe", "bench", "--ep", "2", *TINY, "--iters", "1000000"]
    p = subprocess.Popen(argv + (["--link", link] if link else []), stderr=subprocess.DEVNULL)
    while len(_children(p.pid)) < 2:
        time.sleep(0.02)
    ranks = _children(p.pid)
    time.sleep(3.0)
    t0 = time.monotonic()
    os.kill(p.pid, sig)
    clean = None
    while p.poll() is None or clean is None:
        if clean is None and not any(os.path.exists(f"/proc/{r}") for r in ranks) and not left_by(p.pid):
            clean = time.monotonic() - t0
        if clean is None and p.poll() is not None:  # killed: what it left stays until the next start
            clean = float("nan") if left_by(p.pid) else time.monotonic() - t0
        time.sleep(0.005)
    while any(os.path.exists(f"/proc/{r}") for r in ranks):
        time.sleep(0.005)
    gone = time.monotonic() - t0
    left = left_by(p.pid)
    t1 = time.monotonic()
    swept = sweep_stale_all() if left else ()
    sweep_s = time.monotonic() - t1
    name = signal.Signals(sig).name
    print(f"launcher {name:7s} link={link or '-':6s} exit {p.returncode}: ranks stopped and all removed "
          f"after {clean:.3f} s, ranks and launcher gone after {gone:.3f} s; left {len(left)} "
          f"({', '.join(left) or 'nothing'}); next start swept {len(swept)} in {sweep_s:.3f} s", flush=True)


def squatted_name(reps: int = 7) -> None:
    """Median time of a first segment growth whose first drawn name is free / taken."""
    job = new_token()
    for squat in (False, True, False, True):
        times = []
        for _ in range(reps):
            draws = iter(["00000000000000aa", "00000000000000bb"])
            seg = create_segment(segment_name(job, os.getpid(), "00000000000000aa"), 4096) if squat else None
            heap = SymmetricHeap(job, 0, 1, [os.getpid()], lambda row: row[None],
                                 token=lambda d=draws: next(d))
            t0 = time.perf_counter()
            heap.ensure([HeapNeed(events=1024, fields=())])
            times.append(time.perf_counter() - t0)
            heap.close()
            if seg is not None:
                seg.close()
            sweep(job)
        first = "squatted" if squat else "free"
        print(f"segment growth, first name {first:8s}: median {sorted(times)[reps // 2] * 1e3:.3f} ms "
              f"over {reps}", flush=True)


def _agreement_rank(rank: int, world: int, reps: int) -> tuple[float, float]:
    """Median seconds of a region's agreement and of a bare all-gather of one int64."""
    import torch
    import torch.distributed as dist

    from hpmoe.runtime.agree import RegionKind
    from hpmoe.runtime.session import RuntimeConfig, Session, TransportKind
    from hpmoe.spec import TileSpec, preset
    from hpmoe.weights import ExpertWeights

    w, tiles = ExpertWeights.random(preset("small"), 0), TileSpec()
    with Session(RuntimeConfig(transport=TransportKind.DIST)) as s:
        agree, bare = [], []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            s.agree(RegionKind.FORWARD, w, 1024, tiles)
            agree.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            one = torch.zeros(1, dtype=torch.int64)
            dist.all_gather([torch.empty_like(one) for _ in range(world)], one)
            bare.append(time.perf_counter() - t0)
    return sorted(agree)[reps // 2], sorted(bare)[reps // 2]


def agreement_cost(reps: int = 201) -> None:
    from hpmoe.testing import spawn_gloo

    results = spawn_gloo(_agreement_rank, 2, reps)
    agree, bare = max(r[0] for r in results), max(r[1] for r in results)
    print(f"region agreement (2 ranks, gloo): median {agree * 1e6:.0f} us; a bare 8-byte all-gather "
          f"{bare * 1e6:.0f} us (slowest rank, {reps} repetitions)", flush=True)


def main() -> None:
    record()
    agreement_cost()
    for transport in ("shm", "dist"):
        rank_cases("inputs", transport)
        rank_cases("stall", transport)
    if ROOT and shutil.which("unshare"):
        mount = 'mount -t tmpfs -o size=1m,mode=1777 tmpfs /dev/shm && exec "$@"'
        private = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh"]
        rank_cases("clean", "shm", private)
    for sig, link in ((signal.SIGINT, None), (signal.SIGTERM, None), (signal.SIGKILL, None)):
        signalled_launcher(sig, link)
    if ROOT:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            signalled_launcher(sig, "1gbit")
    squatted_name()
    print(f"left in {SHM_DIR}: {sorted(p.name for p in SHM_DIR.glob('hpmoe-*'))}")


if __name__ == "__main__":
    main()

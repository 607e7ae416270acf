"""Nothing outlives a job, however it ends: a launcher stopped by SIGTERM or Ctrl-C
stops its ranks and removes its directory, segments and namespaces, saying so in
one line; what a SIGKILLed launcher leaves behind is swept by the next start; a
full /dev/shm (a private tmpfs in a mount namespace) is named on every rank instead
of killing them with SIGBUS."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpmoe.launch.launcher import left_by, sweep_stale_all
from hpmoe.runtime.transport.segment import SHM_DIR

TINY = ["--preset", "tiny", "--tokens", "32", "--tile-rows", "8", "--gemm-rows", "8", "--gemm-cols", "16",
        "--warmup", "1", "--schedule", "hyperparallel", "--deadline", "5"]
ROOT = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(not ROOT, reason="network namespaces need root, ip and tc")


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _running_bench(link: str | None) -> tuple[subprocess.Popen, list[int]]:
    """``hpmoe bench`` with 2 ranks that run until stopped; (launcher, rank pids)."""
    argv = [sys.executable, "-m", "hpmoe", "bench", "--ep", "2", *TINY, "--iters", "1000000"]
    p = subprocess.Popen(argv + (["--link", link] if link else []), stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 60.0
    while len(_children(p.pid)) < 2 and time.monotonic() < end:
        time.sleep(0.05)
    ranks = _children(p.pid)
    assert len(ranks) == 2, "the launcher did not start its ranks"
    time.sleep(1.0)
    return p, ranks


def _gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < end:
        time.sleep(0.02)
    return not any(os.path.exists(f"/proc/{p}") for p in pids)


@pytest.mark.parametrize(("sig", "link"), [
    (signal.SIGINT, None), pytest.param(signal.SIGTERM, "1gbit", marks=needs_root)])
def test_a_signalled_launcher_stops_its_ranks_removes_everything_and_says_so_once(sig: int,
                                                                                   link: str | None) -> None:
    segments = sorted(SHM_DIR.glob("hpmoe-*"))
    p, ranks = _running_bench(link)
    assert left_by(p.pid), "the launch directory exists while the job runs"
    os.kill(p.pid, sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + sig
    lines = err.strip().splitlines()  # rank 0's progress lines, then the launcher's one line
    name = signal.Signals(sig).name
    assert lines[-1] == f"hpmoe bench: interrupted by {name}; ranks stopped, nothing left behind"
    assert all(x.startswith("hpmoe bench: iteration ") or x.startswith("hpmoe bench: warm-up ")
               for x in lines[:-1]), lines
    assert _gone(ranks, 0.0) and left_by(p.pid) == []
    assert sorted(SHM_DIR.glob("hpmoe-*")) == segments


def test_what_a_killed_launcher_leaves_is_swept_by_the_next_start() -> None:
    link = "1gbit" if ROOT else None  # with namespaces to leave behind where they can be made
    p, ranks = _running_bench(link)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)
    assert _gone(ranks), "ranks outlived their launcher (PR_SET_PDEATHSIG)"
    left = left_by(p.pid)
    assert left and (link is None or any(n.startswith("hpm-") for n in left))
    swept = sweep_stale_all()
    assert left_by(p.pid) == []
    assert all(any(name in s for s in swept) for name in left), (left, swept)


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="a private tmpfs needs root and unshare --mount")
def test_a_full_dev_shm_is_named_on_every_rank() -> None:
    mount = 'mount -t tmpfs -o size=1m,mode=1777 tmpfs /dev/shm && exec "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh",
            sys.executable, "-m", "hpmoe", "bench", "--ep", "2", *TINY, "--iters", "1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if "stopped:" in x]
    ranks = sorted(x.split(" stopped:")[0] for x in lines)
    assert ranks == ["hpmoe runtime: rank 0", "hpmoe runtime: rank 1"]
    for line in lines:
        assert "/dev/shm is full: rank 0 could not create its 1028.1 KiB shared segment" in line, line
        assert "free (enlarge /dev/shm or use transport=dist)" in line


def _dropped_layers(rank: int, world: int) -> dict:
    """Layers on each transport that train a step and are let go without close():
    hpmoe threads alive and SIGTERM's handler after each, and a layer dropped while its
    output's graph still holds the session (its backward runs after the drop)."""
    import gc
    import threading

    import torch
    import torch.distributed as dist

    from hpmoe import MoE
    from hpmoe.runtime import RuntimeConfig, TransportKind
    from hpmoe.spec import preset

    def ours() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("hpmoe-"))

    spec, handler = preset("tiny"), signal.getsignal(signal.SIGTERM)
    x = torch.randn(16, spec.hidden, requires_grad=True)
    got = {}
    for transport in (TransportKind.SHM, TransportKind.DIST):
        layer = MoE(spec, ep_group=dist.group.WORLD, schedule=None,
                    runtime=RuntimeConfig(transport=transport))
        layer(x).sum().backward()
        running = ours() + ["(handler installed)"] * (signal.getsignal(signal.SIGTERM) is not handler)
        out = layer(x)
        del layer
        gc.collect()
        out.sum().backward()  # the graph holds the session: still open
        del out
        gc.collect()
        restored = signal.getsignal(signal.SIGTERM) is handler
        got[transport.value] = (running, ours(), restored, os.listdir(SHM_DIR))
    return got


def test_a_layer_let_go_without_close_stops_its_threads_and_restores_the_signal_handlers():
    from hpmoe.testing import spawn_gloo

    for transport, (running, after, restored, shm) in spawn_gloo(_dropped_layers, 1, timeout=120)[0].items():
        assert any(n.startswith("hpmoe-worker") for n in running), (transport, running)
        assert "(handler installed)" in running, (transport, running)
        assert after == [] and restored, (transport, after)
        assert not [n for n in shm if n.startswith("hpmoe")], (transport, shm)

"""Run a function on several local gloo ranks, for tests and examples.

``spawn_gloo(fn, world_size, *args)`` starts ``world_size`` processes, joins them
into a gloo process group over a free TCP port on 127.0.0.1, calls
``fn(rank, world_size, *args)`` on each and returns the results by rank.  A failing rank
raises here with its traceback; a stuck rank raises ``TimeoutError``; every child is
joined or terminated before ``spawn_gloo`` returns.

The processes fork from one server (multiprocessing's forkserver) that imported torch and
hpmoe once, single-threaded: a spawned process spent about 3 s importing them on a 2-core
machine, a forked one about 0.05 s.  Each child takes the caller's environment as it is at
the call (a forked child would otherwise see the server's, fixed when it started).
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ("torch", "torch.distributed", "hpmoe")  # what the fork server imports once


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
               threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level); results travel
    back through ``torch.save``.  Each child uses ``threads`` intra-op threads.
    """
    if not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    results: mp.Queue = ctx.Queue()
    port, env = free_port(), dict(os.environ)
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(rank, world_size, port, threads, timeout, fn, args, results, env))
             for rank in range(world_size)]
    ok = False
    try:
        for p in procs:
            p.start()
        out = _collect(results, procs, timeout)
        ok = True
        return out
    finally:
        _stop(procs, grace=10.0 if ok else 0.0)
        results.close()


def _child(rank: int, world_size: int, port: int, threads: int, timeout: float,
           fn: Callable[..., Any], args: tuple[Any, ...], results: mp.Queue, env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        buf = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buf)
        dist.barrier()  # nobody tears down sockets while a peer still reads
        message = (rank, True, buf.getvalue())
    except BaseException:  # report everything, including KeyboardInterrupt
        message = (rank, False, traceback.format_exc())
    results.put(message)
    if dist.is_initialized():
        dist.destroy_process_group()


def _collect(results: mp.Queue, procs: list[Any], timeout: float) -> list[Any]:
    """Wait for one message per rank; raise on the first failure, death or timeout."""
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue_mod.Empty:
            _check_alive(procs, got, deadline, timeout)
            continue
        if not ok:
            raise RuntimeError(f"gloo rank {rank} of {len(procs)} failed:\n{payload}")
        got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [got[rank] for rank in range(len(procs))]


def _check_alive(procs: list[Any], got: dict[int, Any], deadline: float, timeout: float) -> None:
    for rank, p in enumerate(procs):
        if rank not in got and p.exitcode not in (None, 0):
            raise RuntimeError(f"gloo rank {rank} of {len(procs)} died with exit code {p.exitcode}")
    if time.monotonic() > deadline:
        missing = [rank for rank in range(len(procs)) if rank not in got]
        raise TimeoutError(f"gloo ranks {missing} did not finish within timeout={timeout}s")


def _stop(procs: list[Any], grace: float) -> None:
    """Join every started child; terminate (then kill) any still running after ``grace`` s."""
    deadline = time.monotonic() + grace
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join()

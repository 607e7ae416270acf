"""One rank of a distributed ``hpmoe.MoE`` that stalls, started by the launcher
(``python -m tests.layer_fault_rank PATH WHERE``): a clean call on PATH (``path_options``),
then rank 1 stops itself (SIGSTOP) before the next call (WHERE ``before-call``) or inside
it, after the call's agreement and before the path's first exchange (``inside-path``);
rank 0 prints ``diagnosed after T s: <error>`` (T from the call's start) and exits 1 at
once."""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

import hpmoe.nn.layer as layer_module
from hpmoe.nn.layer import MoE
from hpmoe.runtime import RuntimeConfig
from hpmoe.schedule import SchedulePolicy
from hpmoe.spec import DispatchMode, TileSpec, preset
from hpmoe.weights import ExpertWeights

DEADLINE = 2.0
TILES = TileSpec(rows=8, gemm_rows=8, gemm_cols=16)


def path_options(path: str, tiles: TileSpec) -> tuple[SchedulePolicy, TileSpec]:
    """The layer's schedule and tiles for a path name: ``auto`` (the default path; kernel
    by kernel without a profile), a runtime policy (per expert), or ``per-rank`` (the
    deduplicated taskflow under HYPERPARALLEL)."""
    if path == "per-rank":
        return SchedulePolicy.HYPERPARALLEL, replace(tiles, dispatch=DispatchMode.PER_RANK)
    return SchedulePolicy(path), tiles


def _stop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def main(path: str, where: str) -> int:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # far beyond the layer's deadline
    spec = preset("tiny")
    policy, tiles = path_options(path, TILES)
    layer = MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD, tiles=tiles,
                schedule=policy, runtime=RuntimeConfig(deadline_s=DEADLINE))
    x = torch.randn(6, spec.hidden, generator=torch.Generator().manual_seed(rank))
    layer(x)
    if rank == 1 and where == "before-call":
        _stop()
    if rank == 1 and where == "inside-path":
        run = layer_module.run
        layer_module.run = lambda *args: _stop() or run(*args)
    start = time.monotonic()
    try:
        layer(x)
    except Exception as err:
        print(f"diagnosed after {time.monotonic() - start:.3f} s: {type(err).__name__}: {err}",
              file=sys.stderr, flush=True)
        os._exit(1)  # a collective may still be pending: nothing may block the exit
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

"""One rank of a distributed ``hpmoe.MoE`` that stalls, started by the launcher
(``python -m tests.layer_fault_rank PATH WHERE [OUT]``): a clean call on PATH
(``path_options``; its output saved as ``OUT/rank{R}.pt`` for the test to compare with
the dense reference), then rank 1 stops itself (SIGSTOP) before the next call (WHERE
``before-call``) or inside it, after the call's agreement and before the path's first
exchange (``inside-path``); rank 0 prints ``diagnosed after T s: <error>`` (T from the
call's start) and exits 1 at once."""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

import hpmoe.engine.door as door_module
from hpmoe.engine import KernelByKernelPath, RuntimePath
from hpmoe.nn.layer import MoE
from hpmoe.runtime import RuntimeConfig
from hpmoe.schedule import SchedulePolicy
from hpmoe.spec import DispatchMode, TileSpec, preset
from hpmoe.weights import ExpertWeights

from .helpers import ran

DEADLINE = 2.0
TILES = TileSpec(rows=8, gemm_rows=8, gemm_cols=16)


def path_options(path: str, tiles: TileSpec) -> tuple[SchedulePolicy, TileSpec]:
    """The layer's schedule and tiles for a path name: ``auto`` (the default path; kernel
    by kernel without a profile), a runtime policy (per expert), or ``per-rank`` (the
    deduplicated taskflow under HYPERPARALLEL)."""
    if path == "per-rank":
        return SchedulePolicy.HYPERPARALLEL, replace(tiles, dispatch=DispatchMode.PER_RANK)
    return SchedulePolicy(path), tiles


def path_ran(path: str, tiles: TileSpec) -> tuple[type | tuple[type, ...], dict]:
    """The path class (or classes) and the fields that ``helpers.ran`` expects of a clean
    call of a layer of ``path_options(path, tiles)``: ``auto`` tunes on an EP group (each
    call a trial of either path, the tuner's order), a policy runs the runtime."""
    if path == "auto":
        return (KernelByKernelPath, RuntimePath), dict(trial=True)
    policy, tiles = path_options(path, tiles)
    return RuntimePath, dict(policy=policy, tiles=tiles)


def _stop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def inputs(rank: int) -> tuple[torch.Tensor, ExpertWeights]:
    """Rank ``rank``'s tokens [6, H] and the layer's weights (the same on every rank)."""
    spec = preset("tiny")
    x = torch.randn(6, spec.hidden, generator=torch.Generator().manual_seed(rank))
    return x, ExpertWeights.random(spec, 1)


def main(path: str, where: str, out: str | None = None) -> int:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # far beyond the layer's deadline
    policy, tiles = path_options(path, TILES)
    x, weights = inputs(rank)
    layer = MoE(weights.spec, weights, ep_group=dist.group.WORLD, tiles=tiles,
                schedule=policy, runtime=RuntimeConfig(deadline_s=DEADLINE))
    y = layer(x)
    kind, fields = path_ran(path, TILES)
    ran(layer, kind, **fields)
    if out is not None:
        torch.save(y.detach().clone(), os.path.join(out, f"rank{rank}.pt"))
    if rank == 1 and where == "before-call":
        _stop()
    if rank == 1 and where == "inside-path":
        run = door_module.run
        door_module.run = lambda *args: _stop() or run(*args)
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

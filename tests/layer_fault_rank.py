"""One rank of a distributed ``hpmoe.MoE`` that stalls, started by the launcher
(``python -m tests.layer_fault_rank POLICY``): a clean call, then rank 1 stops itself
(SIGSTOP) before the next call; rank 0 prints ``diagnosed after T s: <error>`` (T from
the call's start) and exits 1 at once."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hpmoe.nn.layer import MoE
from hpmoe.runtime import RuntimeConfig
from hpmoe.schedule import SchedulePolicy
from hpmoe.spec import TileSpec, preset
from hpmoe.weights import ExpertWeights

DEADLINE = 2.0
TILES = TileSpec(rows=8, gemm_rows=8, gemm_cols=16)


def main(policy: str) -> int:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # far beyond the layer's deadline
    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD, tiles=TILES,
                schedule=SchedulePolicy(policy), runtime=RuntimeConfig(deadline_s=DEADLINE))
    x = torch.randn(6, spec.hidden, generator=torch.Generator().manual_seed(rank))
    layer(x)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
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

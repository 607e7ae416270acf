"""One rank of the fault cases, started by the launcher (``python -m tests.fault_rank
CASE TRANSPORT [OUT]``).  ``inputs``: a clean region, then one region per input case
(rank 1 faulty), each printing ``CASE: diagnosed after T s: <error>`` (T from the
region's start), then a clean region again (the session survives rejected inputs);
exits 0.  ``stall``: a clean region, then rank 1 stops itself before the next count
exchange; the others print ``stall: diagnosed after T s: <error>`` and exit 1.  Each
clean region's output is saved as ``OUT/rank{R}-clean{N}.pt`` (N from 0) for the test
to compare with the dense reference; any failure of a clean region, and an input case
that raises nothing, print their line and exit 1."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from hpmoe.routing import Routing, RoutingKind, synthetic_routing
from hpmoe.runtime import (
    Fault,
    FaultKind,
    ForwardOptions,
    ForwardRunner,
    RuntimeConfig,
    Session,
    TransportKind,
)
from hpmoe.spec import ParallelSpec, TileSpec, preset
from hpmoe.weights import ExpertWeights

DEADLINE = 2.0
TOKENS = 16
TILES = TileSpec(rows=8, gemm_rows=8, gemm_cols=16)
INPUT_CASES = ("nan", "expert", "empty", "dtype", "tokens", "weights")


def inputs(case: str, rank: int, world: int) -> tuple[torch.Tensor, Routing, ExpertWeights]:
    """Rank ``rank``'s region-2 inputs; rank 1 gets the case's fault."""
    faulty = rank == 1
    moe = preset("tiny", torch.bfloat16 if case == "dtype" and faulty else torch.float32)
    par = ParallelSpec(ep=world, tokens_per_rank=TOKENS)
    r = synthetic_routing(RoutingKind.BALANCED, moe, par, seed=0)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    x = torch.randn(world * TOKENS, moe.hidden, generator=torch.Generator().manual_seed(0))[mine]
    ids, w = r.ids[mine].clone(), r.weights[mine].clone()
    weights = ExpertWeights.random(moe, seed=1 if case == "weights" and faulty else 0)
    if faulty and case == "nan":
        x[13, 2] = float("nan")
    if faulty and case == "expert":
        ids[3, 0] = moe.experts + 3
    keep = {"empty": 0, "tokens": TOKENS - 4}.get(case, TOKENS) if faulty else TOKENS
    return x[:keep].to(moe.dtype).contiguous(), Routing(ids[:keep], w[:keep]), weights


def main(case: str, transport: str, out: str | None = None) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # far beyond the runtime's deadline
    config = RuntimeConfig(transport=TransportKind(transport), deadline_s=DEADLINE, check_weights=True)
    clean = Clean(rank, world, out)
    with torch.no_grad(), Session(config) as s:
        clean(s)
        if case == "stall":
            _region(s, "stall", rank, world, Fault(FaultKind.STALL, rank=1, after=2))
            return 0
        for name in INPUT_CASES:
            _region(s, name, rank, world)
        clean(s)
    dist.destroy_process_group()
    return 0


class Clean:
    """Clean regions of one rank, each output saved under ``out`` (None: not saved)."""

    def __init__(self, rank: int, world: int, out: str | None):
        self.rank, self.world, self.out, self.n = rank, world, out, 0

    def __call__(self, s: Session) -> None:
        x, routing, weights = inputs("clean", self.rank, self.world)
        start = time.monotonic()
        try:
            y = ForwardRunner(s, weights, ForwardOptions(tiles=TILES))(x, routing).out
        except Exception as err:
            _fail("clean", start, err)
        if self.out is not None:
            torch.save(y.clone(), os.path.join(self.out, f"rank{self.rank}-clean{self.n}.pt"))
        self.n += 1


def _region(s: Session, case: str, rank: int, world: int, fault: Fault | None = None) -> None:
    """A region that must fail: a rejected input or a mismatch is printed and the session
    goes on; any other failure, or none, ends the rank."""
    x, routing, weights = inputs(case, rank, world)
    start = time.monotonic()
    try:
        ForwardRunner(s, weights, ForwardOptions(tiles=TILES))(x, routing, fault)
    except (ValueError, TypeError) as err:
        _say(case, start, err)
        return
    except Exception as err:
        _fail(case, start, err)
    print(f"{case}: not diagnosed: the region ran to its end", file=sys.stderr, flush=True)
    os._exit(1)


def _say(case: str, start: float, err: BaseException) -> None:
    print(f"{case}: diagnosed after {time.monotonic() - start:.3f} s: {type(err).__name__}: {err}",
          file=sys.stderr, flush=True)


def _fail(case: str, start: float, err: BaseException) -> NoReturn:
    _say(case, start, err)
    os._exit(1)  # a collective may still be pending: nothing may block the exit


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

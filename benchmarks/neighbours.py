"""How much the call before moves a call's time: kernel by kernel and the default
taskflow of `small` (4096 tok/rank, EP 2, shared memory, fp32), each timed after a
barrier, after itself and after the other (12 pairs per regime; the slowest rank).

    HPMOE_PROFILE=/nonexistent .venv/bin/python benchmarks/neighbours.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from hpmoe.machine import record
from hpmoe.testing import spawn_gloo

PAIRS = 12


def _rank(rank: int, world: int) -> dict[str, list[float]]:
    from hpmoe.bench.runner import BenchConfig, Output, make_inputs, runtime_call
    from hpmoe.exec.arena import ArenaPool
    from hpmoe.exec.kernel_by_kernel import kbk_forward
    from hpmoe.ir.schedule import SchedulePolicy, WorkerCounts
    from hpmoe.routing import RoutingKind
    from hpmoe.runtime.session import RuntimeConfig, Session
    from hpmoe.schedule.tune import Space
    from hpmoe.sim.presets import cpu_nominal
    from hpmoe.spec import TileSpec, preset

    cfg = BenchConfig(moe=preset("small", torch.float32), tokens=4096, routing=RoutingKind.BALANCED, seed=0,
                      tiles=TileSpec(), runtime=RuntimeConfig(), workers=WorkerCounts(1, 1),
                      policy=SchedulePolicy.AUTO)
    data = make_inputs(cfg, world, rank)
    torch.set_num_threads(1)
    with torch.no_grad(), Session(cfg.runtime, None) as s:
        pool = ArenaPool()

        def kbk() -> Output:
            return Output(kbk_forward(data.x, data.routing, data.weights, s.collectives, pool)[0])

        flow = runtime_call(cfg, s, data, Space().default(), cpu_nominal())

        def timed(call: Callable[[], object]) -> float:
            s.collectives.barrier("neighbours", publish=False)
            t0 = time.perf_counter()
            call()
            return time.perf_counter() - t0

        def after(first: Callable[[], object], then: Callable[[], object]) -> list[float]:
            out = []
            for _ in range(PAIRS):
                timed(first)
                out.append(timed(then))
            return out

        for _ in range(3):  # warm-up
            timed(kbk), timed(flow)
        return {"kbk after kbk": after(kbk, kbk), "kbk after taskflow": after(flow, kbk),
                "taskflow after taskflow": after(flow, flow), "taskflow after kbk": after(kbk, flow)}


def main() -> None:
    record()
    ranks = spawn_gloo(_rank, 2, timeout=600)
    for name in ranks[0]:
        slowest = [max(a, b) for a, b in zip(ranks[0][name], ranks[1][name], strict=True)]
        print(f"{name:26s} median {statistics.median(slowest) * 1e3:7.1f} ms  "
              f"fastest {min(slowest) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()

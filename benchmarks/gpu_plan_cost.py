"""What the persistent kernel's host side costs per call, on the machine that runs it.

``bench_gpu.py`` times each persistent region's launch on a plan made once: a layer
whose routing changes every step also plans every step (``hpmoe.gpu.backend``: routing
plan, lowering, task descriptors, schedule, packing), on the host, before the launch.
This times those stages for ``bench_gpu.py``'s shapes (4096 tokens, balanced routing,
one rank, DeepSeek-V3 with 128 experts), forward and backward, with the HYPERPARALLEL
policy on a 92 / 40 split (the split the GPU measured for DeepSeek-V3); the fastest of
``--repeats``.  Needs no GPU: every stage is host code.

    .venv/bin/python benchmarks/gpu_plan_cost.py [--repeats 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import TILES, base_shapes, shape_routing  # noqa: E402

from hpmoe.gpu.buffers import buffer_space  # noqa: E402
from hpmoe.gpu.core import SchedulePolicy, TaskGraph, WorkerCounts  # noqa: E402
from hpmoe.gpu.ops import describe  # noqa: E402
from hpmoe.gpu.pack import pack  # noqa: E402
from hpmoe.gpu.split import scheduled  # noqa: E402
from hpmoe.machine import machine  # noqa: E402
from hpmoe.regions.backward import lower_backward  # noqa: E402
from hpmoe.regions.forward import lower_forward  # noqa: E402
from hpmoe.routing import plan_routing  # noqa: E402
from hpmoe.sim.presets import hardware_preset  # noqa: E402
from hpmoe.spec import MoESpec, ParallelSpec  # noqa: E402

WORKERS, POLICY = WorkerCounts(92, 40), SchedulePolicy.HYPERPARALLEL


def stages(spec: MoESpec) -> dict[str, Callable[[], object]]:
    """Each host stage of one call's forward and backward regions, in order; each stage
    reads what the stages before it made."""
    routing, made = shape_routing(spec, 1), {}
    hw = hardware_preset("h100")

    def region(lower: Callable[[], TaskGraph]) -> dict[str, Callable[[], object]]:
        return {"lower": lambda: made.__setitem__("graph", lower()),
                "describe": lambda: made.__setitem__("tasks", describe(made["graph"], made["space"])),
                "schedule": lambda: made.__setitem__("sched", scheduled(made["graph"], POLICY, hw, WORKERS)),
                "pack": lambda: pack(made["sched"], made["space"], made["tasks"])}

    def plan() -> None:
        made["plan"] = plan_routing(routing.ids, spec, ParallelSpec(ep=1, tokens_per_rank=routing.tokens))
        made["space"] = buffer_space(made["plan"])
    fwd = region(lambda: lower_forward(made["plan"], TILES))
    bwd = region(lambda: lower_backward(made["plan"], TILES))
    return {"plan": plan, **{f"fwd/{k}": f for k, f in fwd.items()},
            **{f"bwd/{k}": f for k, f in bwd.items()}}


def measure(spec: MoESpec, repeats: int) -> dict[str, float]:
    """Fastest milliseconds of each stage over ``repeats`` calls."""
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, step in stages(spec).items():
            t0 = time.perf_counter()
            step()
            best[name] = min(best.get(name, float("inf")), (time.perf_counter() - t0) * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    shapes = {name: dataclasses.replace(spec, experts=128) if name == "deepseek-v3-fit" else spec
              for name, spec in base_shapes().items()}
    print(machine().line())
    report = {"machine": machine().to_json(), "shapes": {}}
    for name, spec in shapes.items():
        ms = measure(spec, a.repeats)
        fwd = ms["plan"] + sum(v for k, v in ms.items() if k.startswith("fwd/"))
        bwd = sum(v for k, v in ms.items() if k.startswith("bwd/"))
        report["shapes"][name] = {"stages_ms": ms, "fwd_ms": fwd, "bwd_ms": bwd}
        print(f"{name:>16}  forward {fwd:7.1f} ms  backward {bwd:7.1f} ms  "
              + "  ".join(f"{k} {v:.1f}" for k, v in ms.items()), flush=True)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a step costs on the host with a plan made once per shape (``hpmoe.gpu.slots``).

``gpu_plan_cost.py`` times the per-routing planning a persistent call pays on the host
(7-17 ms forward and backward on ``bench_gpu.py``'s shapes).  A per-shape program is
built once; a step then only resolves the routing with tensor operations, writes the
task table's routing-dependent entries and the row indices, binds the call's tensors and
uploads their addresses (``SlotProgram.prepare`` + ``SlotProgram.addresses``), before the
one launch; its backward binds dy and its outputs (uninitialised, as a launched backward
leaves them), writes each slot row's routing weight and its task table's entries
(``SlotProgram.prepare_backward``) and uploads its addresses.  This times both, with a
new routing every step (balanced and zipf alternating, a new seed each step), for
``bench_gpu.py``'s 4096 tokens and tiles, one rank, on the CPU: there every tensor
operation runs its work on the host too, so the figure bounds from above what a GPU's
host spends launching the same operations (counted per step: ``ops``; of them the
routing's resolution, with the copy of its row indices into the arena, and the task
table's entries, which a GPU runs as three launches and one).
The program is built for the CPU (the interpreter's device); nothing is launched.
With ``--device cuda`` (a GPU) the program is built there and a step's host time is
timed from an idle device to the step's return, its operations launched (the routing's
resolution three Triton launches, ``gpu.phases.resolve_slots``, the entries one), and
the device's time to the end of its work beside it.

    .venv/bin/python benchmarks/slot_plan_cost.py [--shapes qwen3-30b-a3b small] [--steps 40]
        [--threads 1] [--device cpu] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import TILES, TOKENS, base_shapes  # noqa: E402

from hpmoe.gpu.backend import TritonOptions  # noqa: E402
from hpmoe.gpu.slots import PlanCache, SlotProgram  # noqa: E402
from hpmoe.machine import machine  # noqa: E402
from hpmoe.regions.slot_routing import SlotRouting  # noqa: E402
from hpmoe.routing import Routing, RoutingKind, synthetic_routing  # noqa: E402
from hpmoe.schedule import SchedulePolicy, WorkerCounts  # noqa: E402
from hpmoe.spec import MoESpec, ParallelSpec, preset  # noqa: E402
from hpmoe.weights import ExpertWeights  # noqa: E402

OPTIONS = TritonOptions(policy=SchedulePolicy.HYPERPARALLEL, workers=WorkerCounts(92, 40))


class _CountOps(TorchDispatchMode):
    """Counts the tensor operations dispatched (each a kernel launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def routings(spec: MoESpec, steps: int, device: torch.device) -> list[Routing]:
    """A new routing every step: balanced and zipf alternating, seed = step."""
    par = ParallelSpec(1, TOKENS)
    made = [synthetic_routing(RoutingKind.BALANCED if s % 2 else RoutingKind.ZIPF, spec, par, s)
            for s in range(steps)]
    return [Routing(r.ids.to(device), r.weights.to(device)) for r in made]


def step(program: SlotProgram, x: torch.Tensor, w: ExpertWeights, r: Routing) -> SlotRouting:
    """The forward's host work before its launch; the resolved routing."""
    _, slots = program.prepare(x, w, r)
    program.addresses()
    return slots


def backward_step(program: SlotProgram, dy: torch.Tensor, w: ExpertWeights, r: Routing,
                  slots: SlotRouting) -> None:
    """The backward's host work before its launch, as a launched backward does it."""
    program.prepare_backward(dy, w, r, slots, poison=False)
    program.addresses(program.backward_region.program)


def _idle(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(spec: MoESpec, steps: int, device: torch.device) -> dict[str, float]:
    """Build once (timed), then per step: median and fastest host milliseconds (and on a
    GPU the device's, to the end of the step's work), ops."""
    w = ExpertWeights.random(spec, 0)
    w = dataclasses.replace(w, **{f.name: getattr(w, f.name).to(device) for f in dataclasses.fields(w)
                                  if isinstance(getattr(w, f.name), torch.Tensor)})
    x = torch.randn(TOKENS, spec.hidden, generator=torch.Generator().manual_seed(1)).to(spec.dtype).to(device)
    rs = routings(spec, steps + 1, device)
    cache = PlanCache()
    t0 = time.perf_counter()
    program = cache.program(x, w, rs[0], TILES, OPTIONS)
    build = (time.perf_counter() - t0) * 1e3
    dy = torch.ones_like(x)
    backward_step(program, dy, w, rs[0], step(program, x, w, rs[0]))  # warm-up: the backward region
    times, done, back = [], [], []  # built, on a GPU the launches compiled
    for r in rs[1:]:
        _idle(device)
        t0 = time.perf_counter()
        slots = step(program, x, w, r)
        times.append((time.perf_counter() - t0) * 1e3)
        _idle(device)
        done.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        backward_step(program, dy, w, r, slots)
        back.append((time.perf_counter() - t0) * 1e3)
        _idle(device)
    counter, resolving, columns, backward, backward_columns = (_CountOps() for _ in range(5))
    with counter:
        step(program, x, w, rs[1])
    with resolving:  # the torch version's share, which a GPU runs as three launches
        slots = program._resolved(rs[1])
    with columns:  # the task table's entries, one launch on a GPU
        program.forward_region.columns.apply(program.program.arrays["tasks"], slots)
    with backward:
        backward_step(program, dy, w, rs[1], slots)
    with backward_columns:
        program.backward_region.columns.apply(program.backward_region.program.arrays["tasks"], slots)
    return {"build_ms": build, "step_median_ms": statistics.median(times), "step_min_ms": min(times),
            "step_done_median_ms": statistics.median(done), "ops_per_step": counter.ops,
            "resolution_ops": resolving.ops, "columns_ops": columns.ops,
            "backward_median_ms": statistics.median(back), "backward_min_ms": min(back),
            "backward_ops": backward.ops, "backward_columns_ops": backward_columns.ops,
            "builds": cache.builds, "slots": program.key.shape.slots, "tasks": program.plan.graph.num_tasks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "small"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: a "
                   "step's operations are small; on a GPU they are launches)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the program on a GPU (bf16)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("slot_plan_cost.py: --device cuda, but no CUDA device here", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    known = {**base_shapes(), "tiny": preset("tiny")}
    report = {"machine": machine().to_json(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads(), "tokens": TOKENS, "device": str(device), "shapes": {}}
    print(machine().line(), "| capability", report["cpu_capability"], "| threads", report["threads"])
    for name in a.shapes:
        r = measure(known[name], a.steps, device)
        report["shapes"][name] = r
        print(f"{name:>14}  build {r['build_ms']:8.1f} ms  step median {r['step_median_ms']:.3f} ms  "
              f"fastest {r['step_min_ms']:.3f} ms  done {r['step_done_median_ms']:.3f} ms  "
              f"{r['ops_per_step']} ops ({r['resolution_ops']} resolving, {r['columns_ops']} the task "
              f"table's entries); backward median {r['backward_median_ms']:.3f} ms  fastest "
              f"{r['backward_min_ms']:.3f} ms  {r['backward_ops']} ops ({r['backward_columns_ops']} the task "
              f"table's entries)  {r['slots']} slots  "
              f"{r['tasks']} tasks  builds {r['builds']}",
              flush=True)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU model against the GPU, without a GPU: from ``bench_gpu.py`` JSON files, each
shape's stamped HYPERPARALLEL forward is fitted again with ``hpmoe.gpu.calibrate`` (so a
change of the fit or the simulator is checked on saved measurements), and the model
predicts the forward of every policy whose worker split the file holds (files written
before the splits were saved: HYPERPARALLEL alone).  With several files, each file's
model also predicts the other files' runs of the same shape (another machine of the kind,
another build of the kernel).

    .venv/bin/python benchmarks/gpu_model_check.py FILE.json [FILE.json ...]
        [--matrix 92 106 ...] [--traffic 1.0 ...]

``--matrix`` (programs running matrix tasks, the rest vector) and ``--traffic``
(unpermute traffic in place of the fitted one) print what-if forecasts instead: every
policy as the backend plans it (with the H100 preset), and CRITICAL_PATH planned with
the fitted model; predictions for the next run, to be checked against it.

Prints, per prediction: the file fitted, the file predicted, the policy, predicted and
measured ms and their ratio; exits 1 when a file's graph does not match its timeline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import TILES, base_shapes, shape_routing  # noqa: E402

from hpmoe.gpu.calibrate import calibrate, calibrated_hardware  # noqa: E402
from hpmoe.gpu.core import HardwareModel, SchedulePolicy, TaskGraph, WorkerCounts  # noqa: E402
from hpmoe.gpu.split import scheduled  # noqa: E402
from hpmoe.regions.forward import lower_forward  # noqa: E402
from hpmoe.routing import plan_routing  # noqa: E402
from hpmoe.schedule import QUEUE_POLICIES  # noqa: E402
from hpmoe.sim.presets import hardware_preset  # noqa: E402
from hpmoe.sim.simulate import Timeline, simulate  # noqa: E402
from hpmoe.spec import ParallelSpec  # noqa: E402

PLANNER = hardware_preset("h100")  # the model the GPU backend plans with (TritonOptions.hardware None)


@dataclasses.dataclass
class Run:
    """One file's run of one shape: its graph, measured forwards and fitted model."""

    name: str
    measured: dict[str, float]
    splits: dict[str, list[int]]
    model: HardwareModel
    graph: TaskGraph


def load(path: Path) -> list[Run]:
    """Every shape of a bench_gpu JSON that holds a stamped run, rebuilt and refitted."""
    doc = json.loads(path.read_text())
    runs = []
    for shape, detail in doc.get("calibration", {}).items():
        rows = [r for r in doc["rows"] if r["shape"] == shape]
        ep = rows[0]["ep"]
        spec = dataclasses.replace(base_shapes()[shape], experts=rows[0]["experts"])
        ids = shape_routing(spec, ep).ids
        graph = lower_forward(plan_routing(ids, spec, ParallelSpec(ep, ids.shape[0] // ep)), TILES)
        tl = detail["timeline"]
        if not np.array_equal(np.asarray(tl["kind"]), graph.kind):
            raise SystemExit(f"{path}: {shape}'s graph does not match its timeline (another lowering)")
        workers = WorkerCounts(*tl["workers"])
        sched = scheduled(graph, SchedulePolicy.HYPERPARALLEL, PLANNER, workers)
        timeline = Timeline(ep=ep, workers=workers, kind=graph.kind, rank=graph.rank, peer=graph.peer,
                            unit=graph.unit, worker=np.asarray(tl["worker"]),
                            start=np.asarray(tl["start_us"]) * 1e-6, end=np.asarray(tl["end_us"]) * 1e-6,
                            link_start=np.full(graph.num_tasks, np.nan),
                            link_end=np.full(graph.num_tasks, np.nan))
        model = calibrated_hardware(hardware_preset("h100"), calibrate(sched, timeline), sched, spec.dtype)
        measured = {r["variant"].removeprefix("persistent/"): r["ms"] for r in rows
                    if r["region"] == "fwd" and r["variant"].startswith("persistent/")}
        splits = detail.get("splits", {SchedulePolicy.HYPERPARALLEL.value: list(tl["workers"])})
        runs.append(Run(f"{path.name}:{shape}", measured, splits, model, graph))
    return runs


def predict(model: HardwareModel, run: Run) -> list[tuple[str, float, float]]:
    """(policy, predicted ms, measured ms) of every policy whose split ``run`` holds."""
    out = []
    for policy, (m, v) in run.splits.items():
        sched = scheduled(run.graph, SchedulePolicy(policy), PLANNER, WorkerCounts(m, v))
        out.append((policy, simulate(sched, model).makespan * 1e3, run.measured[policy]))
    return out


def what_if(runs: list[Run], matrix: list[int], traffic: list[float]) -> None:
    """Each run's model with other splits and unpermute traffic, every policy."""
    print("| fitted on | unpermute traffic | policy | matrix / vector programs | predicted ms |")
    print("|---|---:|---|---|---:|")
    for run in runs:
        programs = sum(run.splits[SchedulePolicy.HYPERPARALLEL.value])
        for t in traffic or [run.model.unpermute_traffic]:
            model = dataclasses.replace(run.model, unpermute_traffic=t)
            plans = [(p.value, p, PLANNER) for p in QUEUE_POLICIES]
            plans.append(("critical-path, planned with the fit", SchedulePolicy.CRITICAL_PATH, model))
            for label, policy, planner in plans:
                for m in matrix or [run.splits[SchedulePolicy.HYPERPARALLEL.value][0]]:
                    sched = scheduled(run.graph, policy, planner, WorkerCounts(m, programs - m))
                    print(f"| {run.name} | {t:.2f} | {label} | {m} / {programs - m} | "
                          f"{simulate(sched, model).makespan * 1e3:.3f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--matrix", nargs="*", type=int, default=[])
    p.add_argument("--traffic", nargs="*", type=float, default=[])
    a = p.parse_args(argv)
    runs = [r for f in a.files for r in load(f)]
    if a.matrix or a.traffic:
        what_if(runs, a.matrix, a.traffic)
        return 0
    print("| fitted on | predicts | policy | predicted ms | measured ms | predicted / measured |")
    print("|---|---|---|---:|---:|---:|")
    for fitted in runs:
        for run in runs:
            if run.name.split(":")[1] != fitted.name.split(":")[1]:
                continue
            for policy, pred, meas in predict(fitted.model, run):
                print(f"| {fitted.name} | {run.name} | {policy} | {pred:.3f} | {meas:.3f} | "
                      f"{pred / meas:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

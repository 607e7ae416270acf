"""``hpmoe simulate``: schedule one configuration on a hardware model and replay it."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from ..ir.graph import TaskGraph
from ..migration import Moves, adam_row
from ..placement import starting_placement
from ..regions.dedup_layout import dedup_factor
from ..regions.family import region_family
from ..schedule import QUEUE_POLICIES, Schedule, SchedulePolicy, paper_tiles, schedule
from ..sim.bounds import Bounds
from ..sim.cost import tier_link_bytes
from ..sim.hardware import HardwareModel
from ..sim.presets import HARDWARE_PRESETS, hardware_preset
from ..sim.simulate import SimResult, simulate
from .common import Layer, add_layer_args, emit, layer_from_args
from .overrides import override_fields, with_overrides

_US = 1e6


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="schedule a configuration and replay it on a hardware model")
    add_layer_args(p)
    add_sim_args(p)
    p.set_defaults(run=run)


def add_sim_args(p: argparse.ArgumentParser) -> None:
    """--hardware, --set, --schedule, --backward, --recompute and --paper-tiles."""
    p.add_argument("--hardware", default="ascend-a3", choices=list(HARDWARE_PRESETS),
                   help="hardware model (cpu: the profile written by `hpmoe calibrate`)")
    add_set_arg(p)
    p.add_argument("--schedule", default=SchedulePolicy.CRITICAL_PATH.value,
                   choices=[s.value for s in QUEUE_POLICIES], help="scheduling policy")
    p.add_argument("--backward", action="store_true", help="the backward region instead of the forward")
    p.add_argument("--recompute", action="store_true",
                   help="backward: recompute the SwiGLU activation instead of saving it")
    p.add_argument("--paper-tiles", action="store_true",
                   help="the paper's tiling (one GEMM row block per expert, columns split over the "
                        "matrix workers) instead of --tile-rows/--gemm-rows/--gemm-cols")


def add_set_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a hardware figure, repeatable (e.g. --set l2_mb=0 --set hbm_gbs=800); "
                        f"fields: {', '.join(override_fields())}")


def hardware_from_args(args: argparse.Namespace) -> HardwareModel:
    """The preset named by --hardware with every --set applied."""
    return with_overrides(hardware_preset(args.hardware), args.overrides)


def bounds_json(b: Bounds) -> dict:
    """Every lower bound in µs, and their maximum."""
    return {"matrix_work_us": round(b.matrix_work * _US, 3), "vector_work_us": round(b.vector_work * _US, 3),
            "link_us": round(b.link * _US, 3), "critical_path_us": round(b.critical_path * _US, 3),
            "memory_us": round(b.memory * _US, 3), "max_us": round(b.lower_bound * _US, 3)}


def memory_json(result: SimResult) -> dict:
    """HBM and L2 figures of a replay: the busiest rank's bytes, the lowest hit rate, the
    mean HBM bandwidth of the busiest rank over the makespan and its busy fraction."""
    mem = result.memory
    r = int(mem.hbm_bytes.argmax())
    span = max(result.makespan, 1e-30)
    return {"hbm_bytes": float(mem.hbm_bytes[r]), "hbm_bytes_per_rank": [float(x) for x in mem.hbm_bytes],
            "l2_hit_rate": round(float(mem.l2_hit_rate.min()), 4),
            "l2_hit_rate_per_rank": [round(float(x), 4) for x in mem.l2_hit_rate],
            "hbm_mean_gbs": round(float(mem.hbm_bytes[r]) / span / 1e9, 2),
            "hbm_busy_fraction": round(float(mem.busy[r]) / span, 4)}


@dataclass(frozen=True)
class SimRun:
    """One configuration lowered, scheduled and replayed, with wall times in seconds."""

    layer: Layer
    hardware: HardwareModel
    graph: TaskGraph
    schedule: Schedule
    result: SimResult
    lower_s: float
    schedule_s: float
    simulate_s: float


def run_simulation(args: argparse.Namespace) -> SimRun:
    """Lower, schedule and simulate what the layer and simulation arguments describe."""
    hardware = hardware_from_args(args)
    layer = layer_from_args(args)
    if args.paper_tiles:
        layer = replace(layer, tiles=paper_tiles(hardware))
    t0 = time.perf_counter()
    family = region_family(layer.tiles)
    layout = family.layout(layer.plan, layer.tiles)
    region = family.backward(layout, args.recompute) if args.backward else family.forward(layout)
    graph = region.graph(layer.plan, layer.tiles)
    t1 = time.perf_counter()
    _progress(f"lowered {graph.num_tasks} tasks in {t1 - t0:.1f} s; scheduling ({args.schedule})")
    sched = schedule(graph, SchedulePolicy(args.schedule), hardware)
    t2 = time.perf_counter()
    _progress(f"scheduled in {t2 - t1:.1f} s; replaying on {hardware.name}")
    result = simulate(sched, hardware)
    t3 = time.perf_counter()
    return SimRun(layer=layer, hardware=hardware, graph=graph, schedule=sched, result=result,
                  lower_s=t1 - t0, schedule_s=t2 - t1, simulate_s=t3 - t2)


def _progress(line: str) -> None:
    """A progress line on stderr (stdout stays the result)."""
    print(f"hpmoe: {line}", file=sys.stderr, flush=True)


def summary(args: argparse.Namespace, sim: SimRun) -> dict:
    """The JSON-ready figures of one simulation (times in µs, wall times in s)."""
    b, tiles = sim.result.bounds, sim.layer.tiles
    return {
        "direction": "backward" if args.backward else "forward",
        "preset": args.preset, "ep": args.ep, "tokens_per_rank": args.tokens,
        "routing": sim.layer.routing.value, "hardware": sim.hardware.name, "schedule": args.schedule,
        "candidate": sim.schedule.candidate or args.schedule,
        "tiles": {"rows": tiles.rows, "gemm_rows": tiles.gemm_rows, "gemm_cols": tiles.gemm_cols},
        "nodes": sim.layer.par.nodes,
        "balance": getattr(args, "balance", "none"),
        "expert_slots": sim.layer.moe.experts,
        "ranks_per_token": round(sim.layer.ranks_per_token, 4),
        "dispatch": tiles.dispatch.value,
        "link_bytes": link_bytes_per_rank(sim.graph),
        "link_bytes_per_tier": link_bytes_per_tier(sim.graph),
        "dedup_factor": round(dedup_factor(sim.layer.plan), 4),
        "tasks": int(sim.graph.num_tasks),
        "makespan_us": round(sim.result.makespan * _US, 3),
        "lower_bound_us": round(b.lower_bound * _US, 3),
        "bounds": bounds_json(b),
        **memory_json(sim.result),
        "makespan_over_bound": round(sim.result.makespan / b.lower_bound, 4) if b.lower_bound else None,
        "lower_s": round(sim.lower_s, 3), "schedule_s": round(sim.schedule_s, 3),
        "simulate_s": round(sim.simulate_s, 3),
        **({"move": move_json(sim.layer, sim.hardware)} if sim.layer.placement is not None else {}),
    }


def move_json(layer: Layer, hw: HardwareModel) -> dict:
    """What a layer storing only its own slots moves to reach ``layer.placement`` from
    where it starts (``starting_placement``), training with Adam (``adam_row``): the
    busiest rank's rows and the modelled time (``Moves.seconds``, one link tier)."""
    p = layer.placement
    moves = Moves.between(starting_placement(p.experts, p.ranks, p.slots - p.experts, p.nodes), p)
    nbytes, tensors = adam_row(layer.moe)
    rows = moves.rows()
    return {"rows_per_rank": int(max(rows.sum(0).max(), rows.sum(1).max())), "row_bytes": nbytes,
            "predicted_us": round(moves.seconds(nbytes, tensors, hw) * _US, 3)}


def link_bytes_per_rank(graph: TaskGraph) -> list[int]:
    """Bytes each rank's puts send to other ranks."""
    return [int(b) for b in tier_link_bytes(graph).sum(axis=0)]


def link_bytes_per_tier(graph: TaskGraph) -> dict[str, list[int]]:
    """Bytes each rank's puts send to ranks of its node (``intra``) and of other nodes (``inter``)."""
    intra, inter = tier_link_bytes(graph).astype(np.int64).tolist()
    return {"intra": intra, "inter": inter}


def run(args: argparse.Namespace) -> int:
    emit(summary(args, run_simulation(args)), args.json)
    return 0

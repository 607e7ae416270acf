"""``hpmoe trace``: simulate one configuration and write its Perfetto trace and Gantt chart."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..sim.trace import write_gantt, write_trace
from .common import add_layer_args, emit, require_plotting
from .simulate import add_sim_args, run_simulation, summary


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="write trace.json (Perfetto) and gantt.png of a simulated schedule")
    add_layer_args(p, tokens=512, ep=4)
    add_sim_args(p)
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--ranks", type=int, nargs="+", default=None,
                   help="ranks in the trace (default: all) and the Gantt chart (default: the first two)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    require_plotting("hpmoe trace (gantt.png)")
    sim = run_simulation(args)
    ranks = None if args.ranks is None else tuple(args.ranks)
    timeline = sim.result.timeline
    trace = write_trace(timeline, args.out / "trace.json", ranks)
    picked = sim.schedule.candidate or args.schedule
    sched = args.schedule + (f" (its {picked} candidate)" if picked != args.schedule else "")
    region = "backward" if args.backward else "forward"
    title = (f"{args.preset}, EP {args.ep}, {args.tokens} tokens/rank, {sim.layer.routing.value} routing: "
             f"{region} on {sim.hardware.name}, schedule {sched} (simulated)")
    gantt = write_gantt(timeline, args.out / "gantt.png", ranks, title)
    emit(summary(args, sim) | {"trace": str(trace), "gantt": str(gantt)}, args.json)
    return 0

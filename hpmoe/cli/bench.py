"""``hpmoe bench``: Dispatch-to-Combine latency of the serialized torch.distributed
baseline, of the serial schedule on hpmoe's runtime, and of the taskflow.

Without RANK/WORLD_SIZE in the environment it launches ``--ep`` local ranks itself
(each in its own shaped network namespace with ``--link``); under ``torchrun`` (or
as one of those ranks) it is one rank of the benchmark, and rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from ..bench.order import IterationOrder
from ..bench.report import BenchReport
from ..bench.runner import STEP_NAMES, BenchConfig, run_bench
from ..exec.backend import Backend
from ..ir.schedule import SchedulePolicy, WorkerCounts
from ..launch.launcher import LaunchSpec, launch
from ..launch.netns import LinkSpec
from ..machine import Machine, machine
from ..routing import RoutingKind
from ..runtime.collective import CollectiveError
from ..runtime.faults import Fault
from ..runtime.forensics import RegionError
from ..runtime.session import JOB_ENV, RuntimeConfig
from ..runtime.transport.base import TransportKind
from ..runtime.transport.segment import SegmentError
from ..sim.trace import write_gantt, write_trace
from ..spec import DispatchMode, ParallelSpec, TileSpec, preset
from .common import DTYPES, add_layer_args, balance_redundant, dtype_choice, emit, require_plotting

_OPTIONS = ("preset", "tokens", "routing", "dtype", "seed", "tile_rows", "gemm_rows", "gemm_cols",
            "dispatch", "transport", "schedule", "backend", "workers", "threads", "warmup", "iters",
            "deadline", "fault", "trace", "link", "balance", "order", "block", "paired")
_FLAGS = ("json", "predict", "cache_schedules", "sweep")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure the runtime against the serialized baseline")
    add_layer_args(p, tokens=512, ep=2)
    p.set_defaults(preset="small", ep=None, run=run)
    for action in p._actions:
        if action.dest == "ep":
            action.help = "expert-parallel ranks (default: 2 launched here; WORLD_SIZE under torchrun)"
    p.add_argument("--transport", choices=[TransportKind.SHM.value, TransportKind.DIST.value], default=None,
                   help="shm (one host) or dist (torch.distributed p2p); default shm, dist with --link")
    p.add_argument("--schedule", choices=[s.value for s in SchedulePolicy], default="auto",
                   help="what the default ('taskflow' in the report) runs; auto: AUTO measures the "
                        "candidates of its search space (path, schedule, workers, tiles, dispatch) on the "
                        "bench's forward and runs the fastest, or takes the choice `hpmoe tune` saved")
    p.add_argument("--backend", choices=[Backend.EXACT.value, Backend.KERNEL_BY_KERNEL.value],
                   default=Backend.EXACT.value,
                   help="the default's path: exact runs the taskflow under --schedule (auto: AUTO measures "
                        "every path and runs the fastest); kernel_by_kernel pins that path")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="run ranks in network namespaces joined by links shaped to RATE (e.g. 2gbit)")
    p.add_argument("--workers", default="1,1", help="matrix,vector worker threads per rank")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker and for the baseline")
    p.add_argument("--warmup", type=int, default=5, help="warm-up iterations (the cost model reads them)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations (medians over them)")
    p.add_argument("--order", choices=[o.value for o in IterationOrder], default="balanced",
                   help="balanced: one call of each variant per iteration, every variant after every other "
                        "equally often; blocks: --block back-to-back calls of a variant at a time, as a "
                        "training loop runs its one path")
    p.add_argument("--block", type=int, default=10, help="back-to-back calls per block with --order blocks")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds any wait may take")
    p.add_argument("--predict", action="store_true", help="also replay the schedules on the cpu model")
    p.add_argument("--sweep", action="store_true",
                   help="also time every candidate AUTO's tuning chooses among (the exhaustive sweep; "
                        "the JSON's sweep fields)")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="with --sweep: then N calls each of the default and the sweep's fastest candidate, "
                        "alternating call by call (the JSON's paired fields)")
    p.add_argument("--cache-schedules", action="store_true",
                   help="reuse schedules when token counts repeat (they do here: same inputs)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write trace.json (Perfetto) and gantt.png of the measured taskflow region, and "
                        "predicted-trace.json / predicted-gantt.png with --predict")
    p.add_argument("--fault", default=None, metavar="KIND:RANK[:AFTER]",
                   help="inject a fault to see failures propagate: kill (SIGKILL at kernel AFTER), "
                        "silent (puts move nothing), unreachable (a threshold one too high), stall "
                        "(SIGSTOP before the count exchange of region AFTER)")
    p.add_argument("--timeout", type=float, default=1800.0, help="launcher: wall-time limit (s)")


def _transport(args: argparse.Namespace) -> TransportKind:
    if args.transport is None:
        return TransportKind.DIST if args.link else TransportKind.SHM
    kind = TransportKind(args.transport)
    if args.link and kind is TransportKind.SHM:
        raise ValueError("--link shapes the network between ranks: it needs --transport dist")
    return kind


def _workers(text: str) -> WorkerCounts:
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--workers={text!r} must be MATRIX,VECTOR (e.g. 1,2)")
    return WorkerCounts(matrix=int(parts[0]), vector=int(parts[1]))


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The benchmark the arguments describe (validates them)."""
    # --predict replays the regions on their own kernels; the link is the tuning key's network
    runtime = RuntimeConfig(transport=_transport(args), deadline_s=args.deadline, threads=args.threads,
                            thread_cpu=args.predict, network=args.link or "")
    return BenchConfig(
        moe=preset(args.preset, DTYPES[dtype_choice(args.dtype, on_this_cpu=True)[0]]), tokens=args.tokens,
        routing=RoutingKind(args.routing), seed=args.seed,
        tiles=TileSpec(rows=args.tile_rows, gemm_rows=args.gemm_rows, gemm_cols=args.gemm_cols,
                       dispatch=DispatchMode(args.dispatch)),
        runtime=runtime, workers=_workers(args.workers),
        policy=SchedulePolicy(args.schedule),
        warmup=args.warmup, iters=args.iters,
        link=LinkSpec(args.link) if args.link else None, predict=args.predict,
        cache_schedules=args.cache_schedules, fault=Fault.parse(args.fault) if args.fault else None,
        sweep=args.sweep, balance=balance_redundant(args.balance), order=IterationOrder(args.order),
        block=args.block, paired=args.paired, backend=Backend(args.backend))


def run(args: argparse.Namespace) -> int:
    config = bench_config(args)
    if args.trace:
        require_plotting("hpmoe bench --trace (gantt.png)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _rank_main(args, config)
    ParallelSpec(ep=ranks(args), tokens_per_rank=config.tokens)  # named once, before any rank starts
    return launch_ranks("bench", args, config.moe.experts, config.link, _rank_argv(args))


def ranks(args: argparse.Namespace) -> int:
    """The local ranks ``--ep`` asks for (2 when not given)."""
    return 2 if args.ep is None else args.ep


def launch_ranks(command: str, args: argparse.Namespace, experts: int, link: LinkSpec | None,
                 argv: list[str]) -> int:
    """Run ``hpmoe COMMAND ARGV`` as ``--ep`` local ranks (in shaped namespaces with a link)."""
    result = launch(rank_launch(command, args, experts, link, argv))
    if not result.ok:
        codes = {r.rank: r.returncode for r in result.ranks}
        print(f"hpmoe {command}: ranks failed, exit codes {codes}", file=sys.stderr)
    return result.returncode


def rank_launch(command: str, args: argparse.Namespace, experts: int, link: LinkSpec | None,
                argv: list[str], capture: bool = False) -> LaunchSpec:
    """The launch of ``hpmoe COMMAND ARGV`` as ``--ep`` local ranks under ``--timeout``,
    the ranks' output collected with ``capture``."""
    ep = ranks(args)
    if ep <= 0 or experts % ep:
        raise ValueError(f"--ep={ep} must be a positive divisor of the {experts} experts")
    return LaunchSpec(argv=(sys.executable, "-m", "hpmoe", command, *argv), world=ep,
                      link=link, timeout_s=args.timeout, grace_s=args.deadline + 10.0, capture=capture)


_PROGRESS = re.compile(r"^hpmoe bench: [\w -]+ \d+/\d+ \([\d.]+ s\)$")  # runner.timed_loop's lines


class BenchFailed(RuntimeError):
    """A rank of a ``measure`` run failed; the message holds the ranks' diagnosis."""


def measure(argv: Sequence[str], timeout_s: float) -> dict:
    """``hpmoe bench ARGV --json`` run to completion as its ranks (launched as the command
    launches them, in shaped network namespaces with ``--link``; nothing outlives the
    job) within ``timeout_s``: rank 0's report (fields: docs/bench-json.md).  Raises
    ValueError on bad arguments, ``TopologyError`` when the links cannot be built, and
    ``BenchFailed`` with the ranks' first lines of stderr (the diagnosis) when a rank fails."""
    parser = argparse.ArgumentParser(prog="hpmoe")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv, "--json", "--timeout", str(timeout_s)])
    config = bench_config(args)
    spec = rank_launch("bench", args, config.moe.experts, config.link, _rank_argv(args), capture=True)
    result = launch(spec)
    if not result.ok:
        lines = [line for r in result.ranks for line in r.stderr.splitlines()
                 if line.strip() and not _PROGRESS.match(line)] or ["(no diagnosis printed)"]
        codes = {r.rank: r.returncode for r in result.ranks}
        raise BenchFailed(f"hpmoe bench {' '.join(argv)}: ranks failed, exit codes {codes}: "
                          + " | ".join(lines[:4]))
    return json.loads(result.ranks[0].stdout.strip().splitlines()[-1])


def _rank_argv(args: argparse.Namespace) -> list[str]:
    """The arguments each launched rank gets (every option explicit)."""
    out = []
    for name in _OPTIONS:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out + [f"--{name.replace('_', '-')}" for name in _FLAGS if getattr(args, name)]


def join_group(args: argparse.Namespace, link: LinkSpec | None) -> dist.ProcessGroup:
    """This launched (or torchrun) rank joins the gloo group; the group of every rank,
    whose collectives time out at ``--deadline``."""
    world = int(os.environ["WORLD_SIZE"])
    if args.ep is not None and args.ep != world:
        raise ValueError(f"--ep={args.ep} but WORLD_SIZE={world}")
    if link is not None and JOB_ENV not in os.environ:
        raise ValueError("--link is for hpmoe starting its own ranks, not for torchrun")
    # rendezvous waits for ranks that start late; every collective after it has the deadline
    dist.init_process_group("gloo", timeout=timedelta(seconds=max(60.0, 2 * args.deadline)))
    return dist.new_group(timeout=timedelta(seconds=args.deadline))


def rank_failed(err: BaseException) -> NoReturn:
    """Print a failed rank's diagnosis and exit at once (peers are told; nothing is left
    behind)."""
    if isinstance(err, RegionError | CollectiveError):
        _rank_exit(str(err))
    if isinstance(err, SegmentError):
        _rank_exit(f"hpmoe runtime: rank {dist.get_rank()} stopped: {err}")
    _rank_exit(f"hpmoe runtime: rank {dist.get_rank()} stopped: {type(err).__name__}: {err}")


def _rank_main(args: argparse.Namespace, config: BenchConfig) -> int:
    """One rank: join the gloo group, benchmark, rank 0 prints.  A failed region
    prints its diagnosis and exits at once."""
    group = join_group(args, config.link)
    try:
        report = run_bench(config, group)
    except (RegionError, CollectiveError, SegmentError, RuntimeError) as err:  # RuntimeError: a peer died
        rank_failed(err)
    if dist.get_rank() == 0:
        _print(args, config, report, dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _print(args: argparse.Namespace, config: BenchConfig, report: BenchReport, world: int) -> None:
    dtype, why = dtype_choice(args.dtype, on_this_cpu=True)
    head = {"preset": args.preset, "tokens_per_rank": args.tokens, "routing": args.routing,
            "dtype": dtype, "dtype_auto": why, "machine": machine().to_json(),
            "transport": config.runtime.transport.value,
            "link": args.link, "balance": args.balance, "backend": args.backend,
            "dispatch": args.dispatch, "workers": args.workers, "threads": args.threads,
            "warmup": args.warmup, "iters": args.iters}
    layer = f"{args.preset}, EP {report.ep}, {args.tokens} tokens/rank, {dtype}"
    files = _write_traces(Path(args.trace), report, layer) if args.trace else {}
    doc = head | report.to_json() | files
    if args.json:
        emit(doc, True)
    else:
        print(summary(doc))


def summary(doc: dict) -> str:
    """A few lines for humans from the JSON report ``doc`` (fields: docs/bench-json.md)."""
    def stats(name: str) -> str:
        return (f"{doc[f'{name}_ms']:9.3f} ms  (quartiles {doc[f'{name}_p25_ms']:.3f}-"
                f"{doc[f'{name}_p75_ms']:.3f}, {doc['iters']} iterations)")

    link = f", link {doc['link']}" if doc.get("link") else ""
    ran = f"AUTO's choice, {doc['tune_winner']}" if doc.get("tune_winner") else \
        "kernel by kernel, pinned" if doc.get("backend") == "kernel_by_kernel" else \
        f"the {doc['schedule']} schedule on the runtime"
    steps = ", ".join(f"{k} {doc[f'runtime_taskflow_{k}_ms']:.3f}" for k in STEP_NAMES)
    lines = [
        f"hpmoe bench: {doc['preset']}, {doc['tokens_per_rank']} tokens/rank, EP {doc['ep']}, "
        f"{doc['dtype']}, {doc['routing']} routing, transport {doc['transport']}{link}",
        f"  baseline (serialized torch.distributed) {stats('serial')}",
        f"  hpmoe default                           {stats('taskflow')}",
        f"  kernel-by-kernel path                   {stats('kernel_by_kernel')}",
        f"  speedup {doc['speedup']:.2f}x (hpmoe ran {ran}); the runtime schedule alone: "
        f"{doc['runtime_speedup']:.2f}x over the baseline, "
        f"{doc['runtime_speedup_over_serial_schedule']:.2f}x over the serial schedule",
        f"  hpmoe default over kernel by kernel (the strongest baseline here): "
        f"{doc['kernel_by_kernel_ms'] / doc['taskflow_ms']:.2f}x",
        f"  runtime steps, median ms: {steps}",
        f"  max |hpmoe - baseline| {doc['max_abs_diff']:.3g}; runtime bitwise equal across schedules: "
        f"{'yes' if doc['bitwise_equal_serial_schedule'] else 'NO'}",
    ]
    if "balance_gain" in doc:
        chose = f" (AUTO: {doc['unbalanced_tune_winner']})" if doc.get("unbalanced_tune_winner") else ""
        lines += [f"  the same layer without the placement    {stats('unbalanced')}{chose}",
                  f"  the placement's gain {doc['balance_gain']:.2f}x (fastest iterations "
                  f"{doc['balance_gain_fastest']:.2f}x); max |without - baseline| "
                  f"{doc['unbalanced_max_abs_diff']:.3g}"]
    if doc.get("tune_winner"):
        cost = (f"{doc['tune_steps']} tuning steps, {doc['tune_seconds']:.2f} s, "
                f"at most {doc['tune_max_steps']}"
                if doc["tune_source"] == "measured" else "from the tuning cache, no tuning step")
        lines.append(f"  AUTO measured: {doc['tune_winner']} ({cost}); runner-up {doc['tune_runner_up']}, "
                     f"{doc['tune_gain_over_runner_up']:.2f}x slower")
    if doc.get("sweep_best"):
        lines.append(f"  exhaustive sweep ({len(doc['sweep'])} candidates): best {doc['sweep_best']} "
                     f"{doc['sweep_best_ms']:.3f} ms; default / best {doc['default_over_sweep_best']:.2f} "
                     f"(fastest iterations {doc['default_over_sweep_best_fastest']:.2f})")
        if "paired_candidate" in doc:
            lines.append(f"  paired with {doc['paired_candidate']}, call by call: default / it "
                         f"{doc['default_over_paired']:.2f} "
                         f"(fastest {doc['default_over_paired_fastest']:.2f})")
        if "chosen_over_sweep_best" in doc:
            lines.append(f"  the tuned winner in the sweep / best {doc['chosen_over_sweep_best']:.2f} "
                         f"(fastest {doc['chosen_over_sweep_best_fastest']:.2f})")
    if doc.get("dtype_auto"):
        lines.append(f"  dtype auto: {doc['dtype_auto']}")
    if doc.get("machine"):
        lines.append(f"  machine: {Machine(**doc['machine']).line()}")
    if doc.get("note"):
        lines.append(f"  note: {doc['note']}")
    files = [doc[k] for k in ("trace", "gantt", "predicted_trace", "predicted_gantt") if k in doc]
    if files:
        lines.append(f"  wrote {', '.join(files)}")
    return "\n".join(lines + ["  (every figure: --json; its fields are described in docs/bench-json.md)"])


def _write_traces(out: Path, report: BenchReport, layer: str) -> dict:
    """Measured (and predicted) timelines as Perfetto JSON and Gantt PNGs titled ``layer``."""
    files = {}
    for prefix, timeline in (("", report.timeline), ("predicted-", report.predicted_timeline)):
        if timeline is None:
            continue
        key = prefix.replace("-", "_")
        what = "predicted on the cpu model" if prefix else "measured on this CPU"
        title = f"{layer}: forward, schedule {report.policy.value}, {what}"
        files[f"{key}trace"] = str(write_trace(timeline, out / f"{prefix}trace.json"))
        files[f"{key}gantt"] = str(write_gantt(timeline, out / f"{prefix}gantt.png", title=title))
    return files


def _rank_exit(message: str) -> NoReturn:
    """Print ``message`` as one line in a single write (ranks share the launcher's
    stderr, so a print's separate newline could interleave with a peer's line), then
    exit at once: pending gloo work of a failed region must not block the exit."""
    sys.stderr.flush()
    os.write(2, (message + "\n").encode())
    os._exit(1)

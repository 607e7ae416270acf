"""Where the CPU model misses, per task kind: each task's thread CPU time in the runtime
(``RunTimeline.cpu``) beside the cost the runtime's model
gives it (``sim.cost.task_costs(...).work``: the core time the replay asks of it), and
each rank's process CPU time against its tasks' total; and, inside ``Executor.run``,
each thread's time on a core and waiting in the run queue (``/proc/self/task/*/schedstat``)
and how often the workers went to sleep on a counter; and per timed iteration, the region
against its forecast and against a replay on its kernels' own CPU times
(``print_replays``).  Two ranks, shared-memory
transport (or ``--transport dist``), hyperparallel schedule (or ``--schedule``), one line
per task kind and rank (medians over the iterations after two warm-up ones).  Needs a
calibrated profile (``hpmoe calibrate``).

    .venv/bin/python benchmarks/cpu_task_times.py [--preset small] [--tokens 4096] [--iters 8]
        [--transport shm|dist] [--schedule serial|hyperparallel|critical-path]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import hpmoe.runtime.counters as counters
import hpmoe.runtime.executor as executor
from hpmoe.bench.forecast import agreed_profile
from hpmoe.bench.runner import BenchConfig, bench_models, make_inputs
from hpmoe.ir.graph import TaskKind
from hpmoe.ir.schedule import QUEUE_POLICIES, SchedulePolicy, WorkerCounts
from hpmoe.launch.launcher import LaunchSpec, launch
from hpmoe.machine import record
from hpmoe.routing import RoutingKind
from hpmoe.runtime.forward import ForwardOptions, ForwardRunner
from hpmoe.runtime.session import RuntimeConfig, Session
from hpmoe.runtime.transport.base import TransportKind
from hpmoe.sim.cost import task_costs
from hpmoe.sim.forecast import forecast_region, replay_on_kernels
from hpmoe.spec import TileSpec, preset

BLOCKS = [0]  # waits that found their event short (the worker sleeps), this process


def _counted_block(self, st, task, ev):
    BLOCKS[0] += 1
    return _block(self, st, task, ev)


_block = executor._Run.block
SLEEPS = [0]  # futex sleeps of the workers (a waiter woken short of its threshold sleeps again)
_sleep = counters.Counters.sleep


def _counted_sleep(self, *args):
    SLEEPS[0] += 1
    return _sleep(self, *args)


def schedstat() -> dict[int, tuple[int, int]]:
    """Per thread of this process: (ns on a core, ns runnable in the run queue)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                on_core, queued, _ = map(int, f.read().split())
        except OSError:  # the thread ended
            continue
        out[int(tid)] = (on_core, queued)
    return out


REGION_SCHED: list[dict[str, tuple[float, float]]] = []  # per Executor.run: thread -> (core s, queued s)
_executor_run = executor.Executor.run


def _sched_run(self, *args, **kwargs):
    """``Executor.run`` with every thread's schedstat taken around it, by thread role."""
    before = schedstat()
    try:
        return _executor_run(self, *args, **kwargs)
    finally:
        after, names = schedstat(), {t.native_id: t.name for t in threading.enumerate()}
        roles: dict[str, tuple[float, float]] = {}
        for tid, (core, queued) in after.items():
            core0, queued0 = before.get(tid, (0, 0))
            role = names.get(tid, "other")  # "other": gloo's and torch's own threads
            c, q = roles.get(role, (0.0, 0.0))
            roles[role] = (c + (core - core0) * 1e-9, q + (queued - queued0) * 1e-9)
        REGION_SCHED.append(roles)


def per_kind(kinds: np.ndarray, seconds: np.ndarray) -> dict[str, float]:
    return {TaskKind(k).name: float(seconds[kinds == k].sum()) for k in np.unique(kinds)}


def rank_main(args: argparse.Namespace) -> None:
    executor._Run.block = _counted_block
    executor.Executor.run = _sched_run
    counters.Counters.sleep = _counted_sleep
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    group = dist.new_group(timeout=timedelta(seconds=60))
    rt = RuntimeConfig(transport=TransportKind(args.transport), thread_cpu=True)
    policy = SchedulePolicy(args.schedule)
    cfg = BenchConfig(moe=preset(args.preset), tokens=args.tokens, routing=RoutingKind.BALANCED, seed=0,
                      tiles=TileSpec(), runtime=rt, workers=WorkerCounts(1, 1), policy=policy)
    data, rank = make_inputs(cfg, dist.get_world_size(), dist.get_rank()), dist.get_rank()
    torch.set_num_threads(1)
    rows, runs = [], []
    with torch.no_grad(), Session(rt, group) as s:
        models = bench_models(cfg, agreed_profile(group), group)
        if models is None:
            raise SystemExit("cpu_task_times.py needs a calibrated cpu profile: run `hpmoe calibrate`")
        run = ForwardRunner(s, data.weights, ForwardOptions(tiles=cfg.tiles, policy=policy,
                                                            hardware=models.runtime))
        REGION_SCHED.clear()
        for _ in range(args.iters + 2):
            s.collectives.barrier("iteration", publish=False)
            p0, u0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            m0, b0, z0 = time.thread_time(), BLOCKS[0], SLEEPS[0]
            out = run(data.x, data.routing)
            main_cpu = time.thread_time() - m0
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            kinds = out.schedule.graph.kind[out.program.task_ids]
            cpu = np.zeros(len(kinds))
            cpu[out.timeline.task] = out.timeline.cpu
            kernel = (u1.ru_stime - u0.ru_stime, u1.ru_minflt - u0.ru_minflt,
                      u1.ru_nvcsw - u0.ru_nvcsw, u1.ru_nivcsw - u0.ru_nivcsw, main_cpu, BLOCKS[0] - b0,
                      SLEEPS[0] - z0)
            rows.append((time.process_time() - p0, out.times.region_s, per_kind(kinds, cpu), kernel))
            runs.append((out.program.task_ids, cpu, out.timeline.origin_ns, out.times.region_s))
        g = out.schedule.graph
        mine = g.rank == rank
        model = per_kind(g.kind[mine], task_costs(g, models.runtime).work[mine])
    rows, regions = rows[2:], REGION_SCHED[2:]
    roles = sorted(set().union(*regions))
    doc = {"rank": rank, "share": models.share, "model_s": model,
           "process_cpu_s": statistics.median(r[0] for r in rows),
           "region_s": statistics.median(r[1] for r in rows),
           "task_cpu_s": {k: statistics.median(r[2].get(k, 0.0) for r in rows) for k in model},
           **{name: statistics.median(r[3][i] for r in rows)
              for i, name in enumerate(("system_cpu_s", "page_faults", "voluntary_switches",
                                        "involuntary_switches", "main_thread_cpu_s", "blocked_waits",
                                        "futex_sleeps"))},
           "region_threads_s": {role: [statistics.median(r.get(role, (0.0, 0.0))[k] for r in regions)
                                       for k in (0, 1)] for role in roles},
           "tasks": int(mine.sum())}
    parts, every = [None] * dist.get_world_size(), [None] * dist.get_world_size()
    dist.all_gather_object(parts, doc)
    dist.all_gather_object(every, runs[2:])
    if rank == 0:
        print_table(parts)
        print_replays(out.schedule, models, every)
    dist.barrier()
    dist.destroy_process_group()


def print_table(parts: list[dict]) -> None:
    print("| rank | kind | task CPU ms | model ms | CPU / model |")
    print("|---:|---|---:|---:|---:|")
    for d in parts:
        for k, m in d["model_s"].items():
            c = d["task_cpu_s"][k]
            ratio = c / m if m else float("nan")
            print(f"| {d['rank']} | {k} | {c * 1e3:.2f} | {m * 1e3:.2f} | {ratio:.2f} |")
    for d in parts:
        tasks, model = sum(d["task_cpu_s"].values()), sum(d["model_s"].values())
        print(f"rank {d['rank']}: region {d['region_s'] * 1e3:.1f} ms, process CPU (whole step) "
              f"{d['process_cpu_s'] * 1e3:.1f} ms, tasks' CPU {tasks * 1e3:.1f} ms, "
              f"model {model * 1e3:.1f} ms, share {d['share']:.2f}; of the process CPU "
              f"{d['main_thread_cpu_s'] * 1e3:.1f} ms on the calling thread, "
              f"{d['system_cpu_s'] * 1e3:.1f} ms in the kernel, {d['page_faults']:.0f} page faults, "
              f"{d['voluntary_switches']:.0f} + {d['involuntary_switches']:.0f} context switches "
              f"(voluntary + involuntary); {d['tasks']} tasks, {d['blocked_waits']:.0f} waits found "
              f"their event short, {d['futex_sleeps']:.0f} futex sleeps")
        threads = ", ".join(f"{role} {core * 1e3:.1f} + {queued * 1e3:.1f}"
                            for role, (core, queued) in d["region_threads_s"].items() if core + queued > 5e-5)
        print(f"rank {d['rank']} in the region, ms on a core + ms in the run queue: {threads}")
    print(json.dumps(parts), file=sys.stderr)


def print_replays(schedule, models, every: list[list[tuple]]) -> None:
    """Per timed iteration: the region (its slowest rank) against the forecast on the
    runtime's model and against a replay of the same schedule on that iteration's own
    kernel CPU times (each task's core demand: its measured thread CPU time plus the
    executor's CPU per task; memory not modelled apart, being in the CPU times), both
    with each rank entering when it did.  The second isolates the model of the cores'
    sharing, waits and launch from the kernels' speed."""
    g = schedule.graph
    model_err, replay_err = [], []
    for k in range(len(every[0])):
        cpu = np.zeros(g.num_tasks)
        for rank_runs in every:
            ids, seconds, _, _ = rank_runs[k]
            cpu[ids] = seconds
        origins = np.array([rank_runs[k][2] for rank_runs in every], dtype=np.float64)
        entry = (origins - origins.min()) * 1e-9
        measured = max(rank_runs[k][3] for rank_runs in every)
        forecast = forecast_region(schedule, models.runtime, entry=entry)[0]
        replayed = replay_on_kernels(schedule, models.runtime, cpu, models.host.executor_overhead, entry)
        model_err.append(forecast / measured - 1.0)
        replay_err.append(replayed / measured - 1.0)
        print(f"iteration {k + 1}: region {measured * 1e3:.1f} ms, forecast {forecast * 1e3:.1f} "
              f"({model_err[-1]:+.0%}), replay of its kernels' CPU {replayed * 1e3:.1f} "
              f"({replay_err[-1]:+.0%})")
    print(f"median error: forecast {statistics.median(model_err):+.1%}, replay of the kernels' CPU "
          f"{statistics.median(replay_err):+.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--transport", choices=[t.value for t in TransportKind], default=TransportKind.SHM.value)
    ap.add_argument("--schedule", choices=[p.value for p in QUEUE_POLICIES],
                    default=SchedulePolicy.HYPERPARALLEL.value)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    record()
    if args.rank:
        rank_main(args)
        return
    argv = (sys.executable, __file__, "--rank", "--preset", args.preset, "--tokens",
            str(args.tokens), "--iters", str(args.iters), "--transport", args.transport,
            "--schedule", args.schedule)
    sys.exit(launch(LaunchSpec(argv=argv, world=2, timeout_s=1800)).returncode)


if __name__ == "__main__":
    main()

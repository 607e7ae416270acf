"""``hpmoe demo``: a small DeepSeek-style MoE layer end to end on this machine.

Plan of ``run``:
  1. the exact taskflow forward on virtual ranks against the dense reference;
  2. DeepSeek-V3 at EP 8 simulated on the Ascend A3 model, with its lower bound, a Gantt
     chart and a Perfetto trace;
  3. measured, two local ranks (each ``hpmoe bench`` run with the serialized baseline and
     kernel by kernel beside hpmoe in the same run): over shared memory, and, as root with
     ``ip`` and ``tc``, in network namespaces joined by a shaped link, the case the taskflow
     is for (else one line says what was skipped and how to run it);
  4. measured, skewed routing: the same layer with and without replicas of its hot experts;
  5. on a machine with CUDA, one GPU layer: ``hpmoe.MoE`` against ``torch._grouped_mm`` +
     autograd, forward + backward (else one line);
  6. one table of every comparison, measured here or simulated, with the command that
     reproduces it.
``--quick`` runs the same steps on small layers and few iterations (seconds, for tests).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import refs
from ..bench.torch_peers import default_against_grouped, fit_experts, grouped_mm_unavailable
from ..exec.exact import execute_forward
from ..launch.netns import LinkSpec, TopologyError, link_unavailable
from ..machine import default_cpu_dtype, machine
from ..regions.forward import lower_forward
from ..routing import RoutingKind, plan_routing, route, synthetic_routing
from ..schedule import QUEUE_POLICIES, SchedulePolicy, paper_tiles, schedule
from ..schedule.baseline import strongest_baseline
from ..sim.presets import hardware_preset
from ..sim.simulate import simulate
from ..sim.trace import write_gantt, write_trace
from ..spec import ParallelSpec, TileSpec, preset
from ..weights import ExpertWeights
from .bench import BenchFailed, measure, summary
from .common import require_plotting
from .demo_table import Kind, Row, render
from .info import graph_summary


@dataclass(frozen=True)
class Scale:
    """How much the demo runs.  exact_*: the exact forward's virtual ranks and tokens per
    rank; sim_*: the simulated layer and tokens per rank; preset, tokens, warmup, iters:
    the measured rows' layer, tokens per rank and iterations (``skew_iters`` for the skewed
    row, whose difference is the smallest); tile_rows: the pinned
    taskflow's rows per tile and per GEMM tile; gpu_*: the GPU row's layer, tokens and
    timed calls; timeout_s: the wall-time limit of each measured run."""

    exact_ep: int
    exact_tokens: int
    sim_preset: str
    sim_tokens: int
    preset: str
    tokens: int
    warmup: int
    iters: int
    skew_iters: int
    tile_rows: int
    gpu_preset: str
    gpu_tokens: int
    gpu_reps: int
    timeout_s: float


FULL = Scale(exact_ep=4, exact_tokens=256, sim_preset="deepseek-v3", sim_tokens=4096, preset="small",
             tokens=1024, warmup=2, iters=10, skew_iters=20, tile_rows=256, gpu_preset="deepseek-v3",
             gpu_tokens=4096, gpu_reps=10, timeout_s=300.0)
QUICK = Scale(exact_ep=2, exact_tokens=32, sim_preset="small", sim_tokens=256, preset="tiny", tokens=64,
              warmup=1, iters=2, skew_iters=2, tile_rows=32, gpu_preset="tiny", gpu_tokens=256, gpu_reps=2,
              timeout_s=120.0)
SIM_EP = 8
WHY_THEY_DIFFER = (
    "why the two differ: over shared memory between two cores there is nothing to overlap (the "
    "same two cores move the data and compute), so the taskflow's tiles only add work and kernel "
    "by kernel wins; over a slow link the data moves on the link, not the cores, and the taskflow "
    "hides the link time behind compute, tile by tile.")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run a small DeepSeek-style layer end to end, measured on this machine")
    p.add_argument("--out", type=Path, default=Path("out"), help="directory for traces and plots")
    p.add_argument("--ep", type=int, default=None, help="virtual EP ranks of the exact forward (default 4)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per rank of the exact forward (default 256)")
    p.add_argument("--link", default="1gbit", metavar="RATE",
                   help="rate of the shaped link between the ranks of the linked rows (root)")
    p.add_argument("--quick", action="store_true",
                   help="the same steps on small layers and few iterations (seconds; checks, not figures)")
    p.set_defaults(run=run)


def _section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def exact_forward(ep: int, tokens: int) -> None:
    """Route with the DeepSeek-V3 gate, run the tile graph on virtual ranks, compare."""
    dtype, why = default_cpu_dtype()
    spec = preset("small", dtype)
    _section(f"forward taskflow: preset 'small' ({spec.experts} experts, top-{spec.top_k}, "
             f"H {spec.hidden}, F {spec.ffn}, shared {spec.shared_experts}), EP {ep}, "
             f"{tokens} tok/rank")
    print(f"dtype {why}")
    weights = ExpertWeights.random(spec, seed=0)
    x = torch.randn(ep * tokens, spec.hidden, generator=torch.Generator().manual_seed(1),
                    device="cpu").to(spec.dtype)
    routing = route(x, weights)
    start = time.perf_counter()
    result = execute_forward(x, weights, routing, ep)
    elapsed = time.perf_counter() - start
    ref = refs.dense_moe(x, weights, routing)
    summary_ = graph_summary(result.graph)
    print(f"tasks {summary_['tasks']} ({summary_['tasks_per_unit']}), events {summary_['events']}")
    print(f"exact executor: {elapsed * 1e3:.0f} ms; max |taskflow - dense reference| = "
          f"{(result.out.float() - ref.float()).abs().max().item():.3g}")
    again = execute_forward(x, weights, routing, ep, order=7).out
    print(f"another valid task order gives the same bits: {torch.equal(again, result.out)}")


def simulated_a3(out: Path, scale: Scale) -> Row:
    """``scale.sim_preset`` at EP 8 on the Ascend A3 model: the three policies and the bound."""
    moe, par = preset(scale.sim_preset), ParallelSpec(ep=SIM_EP, tokens_per_rank=scale.sim_tokens)
    layer = f"{scale.sim_preset}, EP {SIM_EP}, {scale.sim_tokens} tok/rank, balanced"
    _section(f"simulated Dispatch-to-Combine, {layer}, ascend-a3")
    hw = hardware_preset("ascend-a3")
    plan = plan_routing(synthetic_routing(RoutingKind.BALANCED, moe, par).ids, moe, par)
    graphs = {SchedulePolicy.HYPERPARALLEL: lower_forward(plan, paper_tiles(hw))}
    default = lower_forward(plan, TileSpec())
    spans = {}
    for policy in QUEUE_POLICIES:
        result = simulate(schedule(graphs.get(policy, default), policy, hw), hw)
        spans[policy] = result.makespan
        if policy is SchedulePolicy.CRITICAL_PATH:
            bound, timeline = result.bounds.lower_bound, result.timeline
    serial = spans[SchedulePolicy.SERIAL]
    strongest = simulate(strongest_baseline(default, plan, hw.workers), hw).makespan
    print(f"{'serial-dedup':>14}: {strongest * 1e6:9.0f} us  (the strongest kernel-by-kernel baseline: "
          f"deduplicated all-to-alls, permute fused)")
    for policy, span in spans.items():
        print(f"{policy.value:>14}: {span * 1e6:9.0f} us  ({serial / span:.2f}x over serial, "
              f"{strongest / span:.2f}x over serial-dedup)")
    cp = spans[SchedulePolicy.CRITICAL_PATH]
    print(f"{'lower bound':>14}: {bound * 1e6:9.0f} us  (critical-path is {cp / bound:.3f}x of it;"
          f" paper reports 1.49-1.58x for its policy)")
    title = f"{layer}: forward on ascend-a3, critical-path (simulated)"
    print(f"Gantt chart of ranks 0-1: {write_gantt(timeline, out / 'gantt_a3.png', (0, 1), title)}")
    print(f"Perfetto trace of rank 0: {write_trace(timeline, out / 'trace_a3.json', (0,))}")
    command = (f"{_hpmoe()} reproduce --preset {scale.sim_preset} --ep {SIM_EP} --tokens {scale.sim_tokens} "
               f"--routing balanced")
    return Row(f"{scale.sim_preset}, EP {SIM_EP}, Ascend A3 model", "critical-path taskflow",
               "serial-dedup (kernel by kernel)", Kind.SIMULATED, command, cp * 1e3, strongest * 1e3)


# ---------------------------------------------------------------------------- measured on this machine


def _python() -> str:
    """This Python as the current directory names it (``.venv/bin/python`` after ``make demo``)."""
    python = Path(sys.executable)
    return str(python.relative_to(Path.cwd()) if python.is_relative_to(Path.cwd()) else python)


def _hpmoe() -> str:
    return f"{_python()} -m hpmoe"


def bench_argv(scale: Scale, *extra: str, iters: int | None = None) -> list[str]:
    """``hpmoe bench`` arguments of a measured row: two ranks, ``scale``'s layer, fp32 (the
    documented figures' dtype), ``iters`` timed iterations (default ``scale.iters``), and
    ``extra``."""
    return ["--ep", "2", "--preset", scale.preset, "--tokens", str(scale.tokens), "--dtype", "fp32",
            "--warmup", str(scale.warmup), "--iters", str(iters or scale.iters), *extra]


def pinned_taskflow(scale: Scale) -> list[str]:
    """What AUTO finds by measuring over a slow link (docs/PERFORMANCE.md): the taskflow
    under the hyperparallel policy, ``scale.tile_rows``-row tiles, per-rank dispatch."""
    rows = str(scale.tile_rows)
    return ["--schedule", "hyperparallel", "--tile-rows", rows, "--gemm-rows", rows, "--dispatch", "per-rank"]


def _run_bench(case: str, argv: list[str], scale: Scale) -> dict | Row:
    """``hpmoe bench ARGV``'s report (its summary printed), or a FAILED row."""
    command = f"{_hpmoe()} bench {' '.join(argv)}"
    print(f"running: {command}", flush=True)
    try:
        doc = measure(argv, scale.timeout_s)
    except BenchFailed as err:
        print(f"failed: {err}", flush=True)
        return Row(case, "-", "-", Kind.FAILED, command, why="ranks failed: the diagnosis is above")
    print(summary(doc), flush=True)
    return doc


def path_rows(case: str, argv: list[str], scale: Scale) -> list[Row]:
    """The pinned taskflow's and kernel by kernel's rows of one ``hpmoe bench`` run, each
    against the serialized baseline of the same run."""
    doc = _run_bench(case, argv, scale)
    if isinstance(doc, Row):
        return [doc]
    return [measured_row(case, f"taskflow (pinned, {scale.tile_rows}-row tiles)", argv, doc, "taskflow"),
            measured_row(case, "kernel by kernel", argv, doc, "kernel_by_kernel")]


def measured_row(case: str, hpmoe: str, argv: list[str], doc: dict, variant: str,
                 against: str = "serialized torch.distributed", baseline: str = "serial") -> Row:
    """The row of ``variant`` against ``baseline``, two variants of one bench report ``doc``."""
    return Row(case, hpmoe, against, Kind.MEASURED, f"{_hpmoe()} bench {' '.join(argv)}",
               doc[f"{variant}_ms"], doc[f"{baseline}_ms"],
               fastest=doc[f"{baseline}_min_ms"] / doc[f"{variant}_min_ms"])


def shared_memory(scale: Scale) -> list[Row]:
    """The pinned taskflow and kernel by kernel, two local ranks over shared memory."""
    _section("measured here: 2 local ranks, shared-memory transport")
    print(f"(preset '{scale.preset}', {scale.tokens} tok/rank, fp32; the serialized baseline runs "
          f"all_to_all_single and one kernel at a time; every variant runs in the same run, interleaved)")
    return path_rows("2 ranks, shared memory", bench_argv(scale, *pinned_taskflow(scale)), scale)


def linked(scale: Scale, rate: str) -> list[Row]:
    """The ranks in network namespaces over a link shaped to ``rate`` (as ``hpmoe bench
    --link`` runs them), or one line saying why not."""
    case, argv = f"2 ranks, {rate} link", bench_argv(scale, *pinned_taskflow(scale), "--link", rate)
    command = f"{_hpmoe()} bench {' '.join(argv)}"
    why = link_unavailable()
    if why is not None:
        print(f"skipped: the {rate}-link rows (ranks in network namespaces joined by a shaped link) need "
              f"root, `ip` and `tc` ({why}); run `sudo make demo`, or as root: {command}", flush=True)
        return [Row(case, "-", "-", Kind.SKIPPED, command, why=f"{why}; needs root, ip, tc")]
    _section(f"measured here: 2 local ranks as two hosts, each in a network namespace, joined by a "
             f"{rate} link")
    auto = f"{_hpmoe()} bench {' '.join(bench_argv(scale, '--link', rate))}"
    print(f"pinned: {' '.join(pinned_taskflow(scale))} (the taskflow under the hyperparallel policy, "
          f"{scale.tile_rows}-row tiles, per-rank dispatch), what AUTO finds by measuring on such a link; "
          f"AUTO's own run, its tuning included: {auto}")
    try:
        return path_rows(case, argv, scale)
    except TopologyError as err:  # root, yet the namespaces cannot be built (a container, say)
        print(f"skipped: the {rate}-link rows: {err}", flush=True)
        return [Row(case, "-", "-", Kind.SKIPPED, command, why=str(err)[:120])]


def skewed(scale: Scale) -> list[Row]:
    """Zipf routing, the same layer with and without two replicas of its hot experts."""
    _section("measured here: skewed routing, the same layer with and without replicas of its hot experts")
    print("(zipf routing sends most tokens to a few experts, so one rank computes while the other waits; "
          "--balance replicate:2 adds two copies of the most loaded experts, placed on this batch's load "
          "(hpmoe.placement), and the layer without them runs beside it in the same run; both pinned to "
          "kernel by kernel, AUTO's choice on shared memory in docs/PERFORMANCE.md, so that the two differ "
          "by the placement alone)")
    argv = bench_argv(scale, "--routing", "zipf", "--balance", "replicate:2", "--backend", "kernel_by_kernel",
                      iters=scale.skew_iters)
    case = "2 ranks, shared memory, zipf routing"
    doc = _run_bench(case, argv, scale)
    if isinstance(doc, Row):
        return [doc]
    return [measured_row(case, "2 replicas of the hot experts", argv, doc, "taskflow",
                         "the same layer without them", "unbalanced")]


def gpu(scale: Scale) -> list[Row]:
    """``hpmoe.MoE`` on the GPU against ``torch._grouped_mm`` + autograd, or one line."""
    command = f"{_python()} benchmarks/bench_gpu.py --peers-only --shapes deepseek-v3-fit"
    case, peer = f"one GPU, {scale.gpu_preset}, {scale.gpu_tokens} tok", "torch._grouped_mm + autograd"
    what = "the GPU row (hpmoe.MoE against torch._grouped_mm + autograd, forward + backward)"
    if not torch.cuda.is_available():
        print(f"skipped: {what} needs a CUDA device; on a machine with one, `make demo` runs it", flush=True)
        return [Row(case, "-", "-", Kind.SKIPPED, command, why="no CUDA device")]
    device = torch.device("cuda")
    why = grouped_mm_unavailable(device, torch.bfloat16)
    if why is not None:
        print(f"skipped: {what}: {why}", flush=True)
        return [Row(case, "-", "-", Kind.SKIPPED, command, why=why[:80])]
    spec = fit_experts(preset(scale.gpu_preset, torch.bfloat16), device)
    _section(f"measured here: one {torch.cuda.get_device_name(device)}, {scale.gpu_preset} "
             f"({spec.experts} experts), {scale.gpu_tokens} tokens, bf16, forward + backward")
    try:
        t = default_against_grouped(spec, scale.gpu_tokens, device, scale.gpu_reps, warmup=3)
    except RuntimeError as err:  # out of memory, a kernel this torch lacks: the row fails, not the demo
        print(f"failed: {type(err).__name__}: {err}", flush=True)
        return [Row(case, "-", "-", Kind.FAILED, command, why=f"{type(err).__name__}: {str(err)[:120]}")]
    print(f"hpmoe.MoE's default path {t.default_ms:.2f} ms, {peer} {t.grouped_ms:.2f} ms: {t.speedup:.2f}x; "
          f"max |difference| of the forward outputs {t.max_abs_diff:.3g}")
    return [Row(case, "hpmoe.MoE (default path)", peer, Kind.MEASURED, command, t.default_ms, t.grouped_ms)]


def run(args: argparse.Namespace) -> int:
    require_plotting("hpmoe demo (its Gantt chart)")
    scale = QUICK if args.quick else FULL
    LinkSpec(args.link)  # a bad rate is named before anything runs
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    exact_forward(args.ep or scale.exact_ep, args.tokens or scale.exact_tokens)
    rows = [simulated_a3(args.out, scale)]
    measured = shared_memory(scale) + linked(scale, args.link)
    print(WHY_THEY_DIFFER)
    rows = measured + skewed(scale) + gpu(scale) + rows
    _section(f"summary: every row measured in this run on this machine, or simulated "
             f"({time.monotonic() - start:.0f} s)")
    print(f"machine: {machine().line()}")
    print(render(rows))
    return 1 if any(r.kind is Kind.FAILED for r in rows) else 0

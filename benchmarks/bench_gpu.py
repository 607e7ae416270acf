"""The MoE region on one GPU: hpmoe's persistent kernel against kernel-by-kernel peers.

Runs only on a CUDA device.  Per shape (4096 tokens, ``--ep`` virtual ranks, default 1:
the single-GPU training case), forward and forward+backward:

  persistent/<policy>     each region ONE persistent Triton kernel (hpmoe.gpu), every policy
  persistent/critical-path-calibrated
                          CRITICAL_PATH planned with the model fitted to this run (below)
                          instead of the H100 preset
  triton-phases           the same tile functions one phase (task kind) at a time, one
                          launch per phase: separates the gain from overlap from kernel quality
  phase/<kind>            each of those phases alone, with its own FLOPs and bytes
  grouped-mm/<kind>       the forward's two expert GEMMs alone through torch._grouped_mm
                          (the rate each GEMM phase is held to)
  hpmoe-kernel-by-kernel  the layer's default path (hpmoe.exec.kernel_by_kernel; on a Hopper
                          GPU in bf16 its GEMMs are grouped GEMMs), backward without autograd
  hpmoe-default           the same path through the front door a user calls: ``hpmoe.MoE``
                          on these weights, ``layer.region(x, ids, weights)``, autograd
  hpmoe-default+cudagraph the same step captured in a CUDA graph (replayed)
  hpmoe-default+offload   the same layer with ``offload=True`` (forward + backward; one
                          layer, so the return of its pre-activation overlaps nothing)
  hpmoe-default+recompute-nothing, +recompute-gemm
                          the same layer with ``recompute="nothing"`` / ``"gemm"``
                          (forward + backward): what each option costs beside the default
  hpmoe-persistent        ``hpmoe.MoE(backend="triton")`` through the front door with a new
                          routing every step (balanced and zipf alternating, a new seed each):
                          the program made once for the shape (``hpmoe.gpu.slots``) bound to
                          each routing, everything a step costs counted (launched without
                          a host sync: a late wait is raised at the next launch)
  hpmoe-persistent+cudagraph
                          the same step captured in a CUDA graph over static ids and weights,
                          each replay after the next routing is copied into them
  torch-eager             kernel by kernel: sort, per-expert F.linear / SwiGLU / F.linear,
                          fixed-order top-k sum; backward by autograd
  torch-grouped-mm        permute, torch._grouped_mm, SwiGLU, torch._grouped_mm, unpermute
  *+cudagraph             the two torch variants captured in CUDA graphs
  hf-grouped-mm, hf-eager transformers' MoE block of the shape's family (router included)
                          with ``experts_implementation`` "grouped_mm" (transformers' default)
                          and "eager"
  hpmoe-from-hf           that very block replaced by ``hpmoe.MoE.from_hf`` (its router,
                          the region on hpmoe's default path)

Every hpmoe and peer row also carries ``host_syncs`` (synchronizing CUDA calls in one
call, counted under ``torch.cuda.set_sync_debug_mode("warn")``), ``peak_mib`` (peak
memory allocated during one call above what was allocated before it) and, for eager
rows, ``saved_mib`` (bytes autograd saved for the backward, parameters excluded, each
storage once); hpmoe-default rows ``host_us`` (the host's time to issue one call, the
device idle before it) beside hpmoe-kernel-by-kernel's: the front door's host cost;
its forward + backward rows and the hpmoe-default+* rows' ``held_mib`` (device memory a
training forward leaves allocated for its backward).
``--routing`` runs the peers on balanced and/or zipf routing.

The stamped HYPERPARALLEL forward run is fitted to a GPU hardware model
(hpmoe.gpu.calibrate: per-task overhead, matrix rate, copy bandwidth per worker,
signal-to-start latency; saved as <out>/calibration-<shape>.json) and the simulator
predicts every policy's forward makespan with it (``predicted_ms``; the measured time
also holds the launch).

Measured in the same run: a plain bf16 GEMM (8192^3) as the tensor-core peak and a 1 GiB
device copy as the memory bandwidth; a variant's roofline fraction is
``max(flops / peak, bytes / bandwidth) / time`` with flops and bytes of the region's task
graph.  Medians over ``--reps`` after ``--warmup`` runs, CUDA events.

    python benchmarks/bench_gpu.py --out benchmarks/results [--shapes small qwen3 ...] [--ep 1] [--peers-only]
        [--routing balanced zipf] [--dry-run]

``--dry-run``: every row's code on shapes cut to a few experts of width 64 and
``DRY_TOKENS`` tokens, one repeat, on the GPU or, without one, on the CPU (Triton's
interpreter for the persistent kernel), before a GPU's time is spent on a script that
fails: what needs CUDA (a CUDA graph, memory statistics, host syncs) is reported as
such, and no figure of a dry run is a measurement.

``--peers-only``: no persistent-kernel rows, only the default path against the torch variants
(``--persistent-layer`` adds back ``hpmoe-persistent``).

Writes <out>/bench_gpu.json and <out>/bench_gpu.md, and the stamped forward run of the
persistent kernel per shape and policy (<out>/timeline-<shape>-<policy>.json, Perfetto
format, and a Gantt .png).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from hpmoe.bench.torch_peers import (
    Peer,
    block_step,
    eager_forward,
    fit_experts,
    grouped_forward,
    hf_block,
    layer_step,
    torch_step,
)
from hpmoe.exec.arena import ArenaPool
from hpmoe.exec.kernel_by_kernel import kbk_backward, kbk_forward
from hpmoe.gpu.backend import TritonOptions, triton_backward, triton_forward
from hpmoe.gpu.calibrate import calibrate, calibrated_hardware
from hpmoe.gpu.pack import pack_tasks
from hpmoe.gpu.runner import DeviceProgram
from hpmoe.gpu.split import cuda_ms
from hpmoe.ir.graph import TaskKind
from hpmoe.machine import machine
from hpmoe.nn.layer import MoE
from hpmoe.regions.backward import lower_backward
from hpmoe.regions.forward import lower_forward
from hpmoe.routing import Routing, RoutingKind, plan_routing, synthetic_routing
from hpmoe.schedule import QUEUE_POLICIES, SchedulePolicy
from hpmoe.sim.hardware import HardwareModel
from hpmoe.sim.presets import hardware_preset
from hpmoe.sim.simulate import simulate
from hpmoe.sim.trace import write_gantt, write_trace
from hpmoe.spec import MoESpec, ParallelSpec, TileSpec, preset
from hpmoe.weights import ExpertWeights

TOKENS = 4096
DRY_TOKENS = 64
TILES = TileSpec(rows=128, gemm_rows=128, gemm_cols=512)
FAMILIES = {"deepseek-v3-fit": "deepseek_v3", "qwen3-30b-a3b": "qwen3_moe", "mixtral-8x7b": "mixtral",
            "small": "qwen3_moe"}  # the transformers block each shape is timed against


def base_shapes() -> dict[str, MoESpec]:
    """The benchmarked layers, DeepSeek-V3 with all its experts."""
    small = MoESpec(hidden=1024, ffn=512, experts=16, top_k=4, dtype=torch.bfloat16)
    return {"deepseek-v3-fit": preset("deepseek-v3", torch.bfloat16),
            "qwen3-30b-a3b": preset("qwen3-30b-a3b", torch.bfloat16),
            "mixtral-8x7b": preset("mixtral-8x7b", torch.bfloat16), "small": small}


def shapes(device: torch.device) -> dict[str, MoESpec]:
    """The benchmarked layers; DeepSeek-V3's expert count is cut to what fits this GPU."""
    return {name: fit_experts(spec, device) if name == "deepseek-v3-fit" else spec
            for name, spec in base_shapes().items()}


def dry_shapes() -> dict[str, MoESpec]:
    """Each benchmarked layer's family cut to 16 experts of width 64 (``--dry-run``)."""
    def cut(spec: MoESpec) -> MoESpec:
        groups = min(spec.groups, 4)
        return dataclasses.replace(spec, hidden=64, ffn=32, experts=16, top_k=min(spec.top_k, 4),
                                   groups=groups, top_groups=min(spec.top_groups, groups))
    return {name: cut(spec) for name, spec in base_shapes().items()}


def on_gpu() -> bool:
    """Whether this run has a CUDA device (a dry run may not)."""
    return torch.cuda.is_available()


def sync() -> None:
    if on_gpu():
        torch.cuda.synchronize()


SLOW_MS, SLOW_REPS = 200.0, 3  # a call slower than this (torch's eager loop on DeepSeek-V3 takes
# 1.4 s) is timed SLOW_REPS times after the probe's warm call: a lease's minutes go to the rows that matter


def timed_ms(fn: Callable[[], object], reps: int, warmup: int) -> float:
    """``gpu.split.cuda_ms`` (median of ``reps`` after ``warmup`` calls; after one probe
    call, ``SLOW_REPS`` and no more warm-up for a call slower than ``SLOW_MS``); without
    a GPU the host clock's median (a dry run)."""
    if on_gpu():
        if cuda_ms(fn, 1, 1) > SLOW_MS:
            reps, warmup = SLOW_REPS, 0
        return cuda_ms(fn, reps, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


# ---------------------------------------------------------------------------- timing

def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (warmed up on a side stream first)."""
    if not on_gpu():
        raise RuntimeError("a CUDA graph needs a CUDA device (dry run)")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def device_peaks(reps: int) -> tuple[float, float]:
    """(bf16 GEMM FLOP/s, device copy bytes/s read + write) measured on this GPU (NaN
    without one)."""
    if not on_gpu():
        return float("nan"), float("nan")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_ms(lambda: a @ a, reps, 3)
    src = torch.empty(1 << 29, device="cuda", dtype=torch.int16)
    dst = torch.empty_like(src)
    copy_ms = cuda_ms(lambda: dst.copy_(src), reps, 3)
    return 2 * 8192 ** 3 / (ms / 1e3), 2 * src.numel() * 2 / (copy_ms / 1e3)


def grouped_gemms(x, w: ExpertWeights, peer: Peer, spec: MoESpec) -> dict:
    """The forward's two expert GEMMs alone through ``torch._grouped_mm`` on rows already
    permuted (the floor each GEMM phase of the persistent kernel is held to), each a
    callable carrying its ``flops`` and ``bytes``."""
    rows = x[peer.order // spec.top_k].contiguous()
    a = torch.randn(rows.shape[0], spec.ffn, device=x.device).to(spec.dtype)
    m, h, f, e = rows.shape[0], spec.hidden, spec.ffn, spec.experts
    size = spec.dtype.itemsize

    def gemm(lhs, weight, flops, nbytes):
        def go():
            return torch._grouped_mm(lhs, weight.transpose(1, 2), offs=peer.offs)
        go.flops, go.bytes = flops, nbytes
        return go
    up_bytes = size * (m * h + e * 2 * f * h + m * 2 * f)
    return {TaskKind.GEMM_UP: gemm(rows, w.w13, 2.0 * m * h * 2 * f, up_bytes),
            TaskKind.GEMM_DOWN: gemm(a, w.w2, 2.0 * m * f * h, size * (m * f + e * h * f + m * h))}


# ---------------------------------------------------------------------------- hpmoe variants

@dataclasses.dataclass
class Phase:
    """One task kind of a region launched on its own: its launcher and its work."""

    kind: TaskKind
    launch: Callable[[], None]
    flops: float
    bytes: float


def phase_programs(region, queues: int) -> list[Phase]:
    """One launcher per phase (task kind, in lowering order) of a prepared region."""
    g, arena = region.schedule.graph, region.arena
    kinds = list(dict.fromkeys(g.kind.tolist()))
    out = []
    for k in kinds:
        ids = np.flatnonzero(g.kind == k)
        packed = pack_tasks(g, arena.space, ids, min(queues, len(ids)))
        program = DeviceProgram(packed, arena.device, arena.dtype, region.program.config)
        out.append(Phase(TaskKind(k), program.launcher(arena.addresses()), float(g.flops[ids].sum()),
                         float(g.bytes[ids].sum())))
    return out


def shape_routing(spec: MoESpec, ep: int, kind: RoutingKind = RoutingKind.BALANCED,
                  tokens: int = TOKENS) -> Routing:
    """The routing of ``tokens`` tokens every variant runs (on the CPU)."""
    return synthetic_routing(kind, spec, ParallelSpec(ep, tokens // ep), 0)


def shape_inputs(spec: MoESpec, ep: int, kind: RoutingKind = RoutingKind.BALANCED, tokens: int = TOKENS
                 ) -> tuple[torch.Tensor, ExpertWeights, Routing, torch.Tensor]:
    """(x, weights, the routing of ``kind``, dy) of ``tokens`` tokens on the GPU (a dry
    run without one: the CPU)."""
    dev = torch.device("cuda" if on_gpu() else "cpu")
    w = ExpertWeights.random(spec, 0)
    w = dataclasses.replace(w, **{f.name: getattr(w, f.name).to(dev) for f in dataclasses.fields(w)
                                  if isinstance(getattr(w, f.name), torch.Tensor)})
    routing = shape_routing(spec, ep, kind, tokens)
    routing = Routing(ids=routing.ids.to(dev), weights=routing.weights.to(dev))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, spec.hidden, generator=g).to(spec.dtype).to(dev)
    dy = torch.randn(tokens, spec.hidden, generator=g).to(spec.dtype).to(dev)
    return x, w, routing, dy


def region_work(spec: MoESpec, ep: int, routing: Routing) -> dict[str, tuple[float, float]]:
    """FLOPs and bytes of the forward and forward+backward task graphs (host only)."""
    par = ParallelSpec(ep=ep, tokens_per_rank=routing.ids.shape[0] // ep)
    plan = plan_routing(routing.ids.cpu(), spec, par)
    gf, gb = lower_forward(plan, TILES), lower_backward(plan, TILES)
    fwd = (float(gf.flops.sum()), float(gf.bytes.sum()))
    return {"fwd": fwd, "fwd+bwd": (fwd[0] + float(gb.flops.sum()), fwd[1] + float(gb.bytes.sum()))}


def persistent_rows(name: str, spec: MoESpec, ep: int, inputs: tuple, record: Callable, rows: list[dict],
                    out_dir: Path, details: dict) -> None:
    """The persistent kernel's rows of one shape: every policy, the calibrated plan, the
    phases; the model fitted into ``details``."""
    x, w, routing, dy = inputs
    fwd_regions = {}
    for policy in QUEUE_POLICIES:
        fwd = triton_forward(x, w, routing, ep, TILES, TritonOptions(policy=policy, stamps=True))
        bwd = triton_backward(fwd, dy)
        save_timeline(fwd, out_dir / f"timeline-{name}-{policy.value}.json")
        f_go = fwd.region.program.launcher(fwd.region.arena.addresses())
        b_go = bwd.region.program.launcher(bwd.region.arena.addresses())
        record("fwd", f"persistent/{policy.value}", f_go, launchers=(f_go,))
        record("fwd+bwd", f"persistent/{policy.value}", lambda f=f_go, b=b_go: (f(), b()),
               launchers=(f_go, b_go))
        fwd_regions[policy] = (fwd, bwd)
    details[name], model = predict(rows, name, fwd_regions, spec, out_dir)
    try:
        f_go, b_go, predicted = calibrated_critical_path(x, w, routing, dy, ep, model)
        error = ""
    except Exception as e:  # reported as the variant's error, not fatal to the other variants
        f_go = b_go = None
        predicted, error = float("nan"), f"{type(e).__name__}: {e}"
    launchers = (f_go, b_go) if f_go else ()
    record("fwd", "persistent/critical-path-calibrated", f_go, error, launchers=launchers[:1])
    rows[-1]["predicted_ms"] = predicted
    record("fwd+bwd", "persistent/critical-path-calibrated", f_go and (lambda: (f_go(), b_go())), error,
           launchers=launchers)
    fwd, bwd = fwd_regions[SchedulePolicy.HYPERPARALLEL]
    queues = fwd.region.program.packed.num_queues
    f_phases, b_phases = phase_programs(fwd.region, queues), phase_programs(bwd.region, queues)
    f_go = [p.launch for p in f_phases]
    fb_go = f_go + [p.launch for p in b_phases]
    record("fwd", "triton-phases", lambda: [p() for p in f_go], launchers=tuple(f_go))
    record("fwd+bwd", "triton-phases", lambda: [p() for p in fb_go], launchers=tuple(fb_go))
    for region, phases in (("fwd", f_phases), ("bwd", b_phases)):
        for p in phases:
            record(region, f"phase/{p.kind.name.lower()}", p.launch, launchers=(p.launch,),
                   phase_work=(p.flops, p.bytes))


def run_shape(name: str, spec: MoESpec, ep: int, reps: int, warmup: int, peaks: tuple[float, float],
              out_dir: Path, details: dict, persistent: bool = True,
              kind: RoutingKind = RoutingKind.BALANCED, layer_persistent: bool = False,
              tokens: int = TOKENS) -> list[dict]:
    x, w, routing, dy = shape_inputs(spec, ep, kind, tokens)
    rows: list[dict] = []
    work = region_work(spec, ep, routing)

    def record(region: str, variant: str, fn: Callable[[], object] | None, error: str = "",
               launchers: tuple = (), phase_work: tuple[float, float] | None = None,
               measured: dict | None = None) -> None:
        ms = float("nan")
        if fn is not None:
            try:
                ms = timed_ms(fn, reps, warmup)
                error = late_waits(launchers)
            except Exception as e:  # a peer a torch build does not support is reported, not fatal
                error = f"{type(e).__name__}: {e}"
            if error:
                ms = float("nan")  # a run that hit its deadline is no timing
        flops, nbytes = phase_work or work.get(region, (float("nan"), float("nan")))
        roof = max(flops / peaks[0], nbytes / peaks[1]) * 1e3
        rows.append({"shape": name, "experts": spec.experts, "ep": ep, "routing": kind.value,
                     "region": region, "variant": variant, "ms": ms, "tflops": flops / (ms / 1e3) / 1e12,
                     "roofline_fraction": roof / ms, "error": error, **(measured or {})})
        print(f"{name:>16} {kind.value:>8} {region:>8} {variant:>32} {ms:9.3f} ms  {measured or ''} {error}",
              flush=True)

    if persistent and kind is RoutingKind.BALANCED:
        with reported(record, "fwd", "persistent"):
            persistent_rows(name, spec, ep, (x, w, routing, dy), record, rows, out_dir, details)
    default_and_torch_rows(spec, (x, w, routing, dy), reps, record)
    if (persistent or layer_persistent) and kind is RoutingKind.BALANCED:  # its own routings, new each step
        persistent_layer_rows(spec, (x, w, dy), reps, record)
    del w  # the hf block's weights take its place
    torch.cuda.empty_cache()
    hf_rows(name, spec, x, dy, record)
    return rows


@contextlib.contextmanager
def reported(record: Callable, region: str, variant: str) -> Iterator[None]:
    """A failure while a row is set up or measured is that row's error, not the end of the
    shape's other rows (a GPU's time is scarce)."""
    try:
        yield
    except Exception as e:
        traceback.print_exc()
        record(region, variant, None, f"{type(e).__name__}: {e}")


def default_and_torch_rows(spec: MoESpec, inputs: tuple, reps: int, record: Callable) -> None:
    """hpmoe's default path (called bare and through the layer, eager and graphed) and
    the torch variants, forward and forward+backward."""
    x, w, routing, dy = inputs
    pool = ArenaPool()

    def kbk(save: bool) -> Callable[[], object]:
        if not save:
            return lambda: kbk_forward(x, routing, w, pool=pool)
        return lambda: kbk_backward(kbk_forward(x, routing, w, pool=pool, save=True)[1], dy, pool)

    for region, save in (("fwd", False), ("fwd+bwd", True)):
        with reported(record, region, "hpmoe-kernel-by-kernel"):
            step = kbk(save)
            record(region, "hpmoe-kernel-by-kernel", step, measured={"host_us": host_us(step, reps)})
    layer = MoE(spec, w)  # a copy of the same weights
    params = list(layer.parameters())
    for region, backward in (("fwd", False), ("fwd+bwd", True)):
        step = layer_step(layer, x, routing, dy, backward)
        with reported(record, region, "hpmoe-default"):
            measured = {**measure(step, params), "host_us": host_us(step, reps)}
            if backward:
                measured["held_mib"] = held_mib(layer, x, routing)
            record(region, "hpmoe-default", step, measured=measured)
        record_graphed(record, region, "hpmoe-default", step)
    del layer
    for label, option in (("offload", dict(offload=True)), ("recompute-nothing", dict(recompute="nothing")),
                          ("recompute-gemm", dict(recompute="gemm"))):
        with reported(record, "fwd+bwd", f"hpmoe-default+{label}"):
            other = MoE(spec, w, **option)  # the default path with one option changed
            step = layer_step(other, x, routing, dy, True)
            held = held_mib(other, x, routing)
            record("fwd+bwd", f"hpmoe-default+{label}", step, measured={"held_mib": held})
    peer = Peer.of(routing, spec)
    for gemm_kind, gemm in grouped_gemms(x, w, peer, spec).items():
        record("fwd", f"grouped-mm/{gemm_kind.name.lower()}", gemm, phase_work=(gemm.flops, gemm.bytes))
    for label, forward in (("torch-eager", eager_forward), ("torch-grouped-mm", grouped_forward)):
        for region, backward in (("fwd", False), ("fwd+bwd", True)):
            step = torch_step(forward, x, w, routing, dy, peer, backward)
            with reported(record, region, label):
                record(region, label, step, measured=measure(step, [w.w13, w.w2, w.shared_w13, w.shared_w2]))
            record_graphed(record, region, label, step)


def persistent_layer_rows(spec: MoESpec, inputs: tuple, reps: int, record: Callable, steps: int = 8) -> None:
    """``hpmoe-persistent``, forward and forward+backward: the layer pinned to the
    persistent kernel, each call on the next of ``steps`` routings (new ones every
    step as far as the timing's repeats go)."""
    x, w, dy = inputs
    with reported(record, "fwd", "hpmoe-persistent"):
        _persistent_layer_rows(spec, x, w, dy, reps, record, steps)


def _persistent_layer_rows(spec: MoESpec, x: torch.Tensor, w: ExpertWeights, dy: torch.Tensor, reps: int,
                           record: Callable, steps: int) -> None:
    layer = MoE(spec, w, backend="triton", tiles=TILES)
    par = ParallelSpec(1, x.shape[0])
    drawn = [synthetic_routing(RoutingKind.ZIPF if s % 2 else RoutingKind.BALANCED, spec, par, s)
             for s in range(steps)]
    routings = [Routing(r.ids.to(x.device), r.weights.to(x.device)) for r in drawn]
    for region, backward in (("fwd", False), ("fwd+bwd", True)):
        cycle = itertools.cycle([layer_step(layer, x, r, dy, backward) for r in routings])

        def step(cycle=cycle) -> object:
            return next(cycle)()

        measured = {**measure(step, list(layer.parameters())), "host_us": host_us(step, reps)}
        record(region, "hpmoe-persistent", step, measured=measured)
        with reported(record, region, "hpmoe-persistent+cudagraph"):
            replay = renewed_replay(layer, x, routings, dy, backward)
            record(region, "hpmoe-persistent+cudagraph", replay, measured={"host_us": host_us(replay, reps)})


def renewed_replay(layer: MoE, x: torch.Tensor, routings: list[Routing], dy: torch.Tensor,
                   backward: bool) -> Callable[[], None]:
    """The layer's step captured in a CUDA graph over static ids and routing weights; each
    call copies the next of ``routings`` into them and replays (a new routing a step)."""
    static = Routing(routings[0].ids.clone(), routings[0].weights.clone())
    replay, nexts = graphed(layer_step(layer, x, static, dy, backward)), itertools.cycle(routings)

    def step() -> None:
        r = next(nexts)
        static.ids.copy_(r.ids)
        static.weights.copy_(r.weights)
        replay()
    return step


def hf_rows(name: str, spec: MoESpec, x: torch.Tensor, dy: torch.Tensor, record: Callable) -> None:
    """transformers' block of the shape's family under "grouped_mm" and "eager", and the
    same block replaced by ``hpmoe.MoE.from_hf``, forward and forward+backward."""
    try:
        block = hf_block(FAMILIES[name], spec, x.device)
    except Exception as e:  # a transformers without this block is reported, not fatal
        record("fwd", "hf-grouped-mm", None, f"{type(e).__name__}: {e}")
        return
    layer = MoE.from_hf(block)
    params = list(block.parameters())
    for region, backward in (("fwd", False), ("fwd+bwd", True)):
        for label, module, impl in (("hf-grouped-mm", block, "grouped_mm"), ("hf-eager", block, "eager"),
                                    ("hpmoe-from-hf", layer, "hpmoe")):
            step = block_step(module, block, impl, x, dy, backward)
            with reported(record, region, label):
                record(region, label, step, measured=measure(step, params))
    del layer, block, params
    torch.cuda.empty_cache()


def record_graphed(record: Callable, region: str, label: str, step: Callable[[], object]) -> None:
    """``label``'s step captured in a CUDA graph, timed by its replays (peak memory of one)."""
    try:
        replay = graphed(step)
    except Exception as e:
        record(region, f"{label}+cudagraph", None, f"{type(e).__name__}: {e}")
        return
    record(region, f"{label}+cudagraph", replay, measured={"peak_mib": measure(replay, [])["peak_mib"]})


def host_syncs(fn: Callable[[], object]) -> int | None:
    """Synchronizing CUDA calls one call of ``fn`` makes (torch's sync debug mode warns
    at each; None without a GPU)."""
    if not on_gpu():
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def measure(fn: Callable[[], object], params: list) -> dict:
    """One call of ``fn``: its host syncs, its peak memory above what was allocated before
    (MiB) and the bytes autograd saved for the backward in it (MiB; each storage once,
    the ``params``' storages excluded)."""
    syncs = host_syncs(fn)
    skip = {p.untyped_storage().data_ptr() for p in params if p is not None}
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and ptr not in seen:
            seen.add(ptr)
            sizes.append(t.untyped_storage().nbytes())
        return t

    sizes: list[int] = []
    sync()
    if on_gpu():
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if on_gpu() else 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    sync()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if on_gpu() else float("nan")
    return {"host_syncs": syncs, "peak_mib": peak, "saved_mib": sum(sizes) / 2**20}


def held_mib(layer: MoE, x: torch.Tensor, routing: Routing) -> float:
    """Device memory (MiB) one training forward of ``layer`` leaves allocated for its
    backward, its output included (without a GPU the forward runs, NaN)."""
    xl, wl = (t.detach().requires_grad_() for t in (x, routing.weights))
    if not on_gpu():
        layer.region(xl, routing.ids, wl)
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = layer.region(xl, routing.ids, wl)
    torch.cuda.synchronize()
    torch.empty(1, device=x.device)  # an allocation settles frees that waited on another stream's copies
    held = torch.cuda.memory_allocated() - before
    del out
    return held / 2**20


def host_us(fn: Callable[[], object], reps: int) -> float:
    """Median microseconds the host takes to issue one call of ``fn``, the device idle
    before each (the call's Python and launches, without waiting for its kernels)."""
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    sync()
    return float(np.median(times))


def calibrated_critical_path(x, w: ExpertWeights, routing: Routing, dy, ep: int,
                             model: HardwareModel) -> tuple[Callable, Callable, float]:
    """CRITICAL_PATH planned with ``model``, the model fitted to this device's stamped run
    (the backend plans with the H100 preset unless given one): the forward and backward
    launchers and the model's forward makespan, ms."""
    fwd = triton_forward(x, w, routing, ep, TILES,
                         TritonOptions(policy=SchedulePolicy.CRITICAL_PATH, hardware=model))
    bwd = triton_backward(fwd, dy)
    predicted = simulate(fwd.region.schedule, model).makespan * 1e3
    return (fwd.region.program.launcher(fwd.region.arena.addresses()),
            bwd.region.program.launcher(bwd.region.arena.addresses()), predicted)


def late_waits(launchers: tuple) -> str:
    """"" when no launch of ``launchers`` (``DeviceProgram.launcher``) had a wait pass its
    deadline, else what to report instead of a time."""
    sync()
    late = sum(int((go.errors[:, 0] != 0).sum()) for go in launchers)
    return f"{late} wait(s) passed the deadline: not timed" if late else ""


def predict(rows: list[dict], name: str, regions: dict, spec: MoESpec,
            out_dir: Path) -> tuple[dict, HardwareModel]:
    """Fit a GPU model to the stamped HYPERPARALLEL forward run and predict every policy's
    forward makespan with the simulator (rows get ``predicted_ms``).  Returns a record
    of the fit, the model, the stamped timeline (per task: kind, unit, worker, start and
    end in us) and each policy's worker split, so the fit can be examined without the GPU
    (``benchmarks/gpu_model_check.py``; also saved as calibration-<shape>.json), and the
    model."""
    fwd = regions[SchedulePolicy.HYPERPARALLEL][0]
    sched = fwd.region.schedule
    tl = fwd.region.program.timeline(fwd.info.stamps)
    cal = calibrate(sched, tl)
    model = calibrated_hardware(hardware_preset("h100"), cal, sched, spec.dtype)
    stamped = {"kind": tl.kind.tolist(), "unit": tl.unit.tolist(), "worker": tl.worker.tolist(),
               "start_us": (tl.start * 1e6).round(3).tolist(), "end_us": (tl.end * 1e6).round(3).tolist(),
               "workers": [tl.workers.matrix, tl.workers.vector]}
    splits = {p.value: [f.region.schedule.workers.matrix, f.region.schedule.workers.vector]
              for p, (f, _) in regions.items()}
    detail = {"fit": dataclasses.asdict(cal), "model": model.to_dict(), "timeline": stamped, "splits": splits}
    (out_dir / f"calibration-{name}.json").write_text(json.dumps(detail, indent=1))
    for policy, (f, _) in regions.items():
        ms = simulate(f.region.schedule, model).makespan * 1e3
        for r in rows:
            if r["shape"] == name and r["region"] == "fwd" and r["variant"] == f"persistent/{policy.value}":
                r["predicted_ms"] = ms
                print(f"{name:>16} fwd {policy.value:>24} predicted {ms:9.3f} ms, measured {r['ms']:9.3f} ms")
    return detail, model


def save_timeline(fwd, path: Path) -> None:
    """The stamped forward run as a Perfetto trace and a Gantt PNG (when matplotlib is there)."""
    tl = fwd.region.program.timeline(fwd.info.stamps)
    write_trace(tl, path)
    with contextlib.suppress(ImportError):
        write_gantt(tl, path.with_suffix(".png"))


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"GPU: {meta['device']}; torch {meta['torch']}; triton {meta['triton']}; "
             f"bf16 GEMM peak {meta['peak_tflops']:.0f} TFLOP/s; copy {meta['copy_gbs']:.0f} GB/s (measured)",
             "",
             "| shape | routing | region | variant | ms | predicted ms | TFLOP/s | roofline | syncs "
             "| peak MiB | saved MiB | host us | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in rows:
        pred = r.get("predicted_ms", nan)
        lines.append(f"| {r['shape']} (E {r['experts']}, EP {r['ep']}) | {r.get('routing', '-')} | "
                     f"{r['region']} | {r['variant']} | {r['ms']:.3f} | {pred:.3f} | {r['tflops']:.1f} | "
                     f"{r['roofline_fraction']:.2f} | {r.get('host_syncs', '-')} | "
                     f"{r.get('peak_mib', nan):.0f} | {r.get('saved_mib', nan):.0f} | "
                     f"{r.get('host_us', nan):.0f} | {r['error'][:60]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help="where bench_gpu.json/.md go (default benchmarks/results; a dry run's: "
                        "out/bench_gpu-dry-run)")
    p.add_argument("--shapes", nargs="*", default=None, help="the layers, in this order (default: all four)")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--peers-only", action="store_true",
                   help="no persistent-kernel rows: the default path against the torch variants")
    p.add_argument("--persistent-layer", action="store_true",
                   help="with --peers-only, still the hpmoe-persistent rows (the layer on the persistent "
                        "kernel, a new routing every step)")
    p.add_argument("--routing", nargs="*", default=["balanced"], choices=[k.value for k in RoutingKind],
                   help="routings the peers run (the persistent rows: balanced only)")
    p.add_argument("--dry-run", action="store_true",
                   help="every row's code on cut shapes, one repeat (on the CPU without a GPU): no "
                        "measurement")
    a = p.parse_args(argv)
    if not on_gpu() and not a.dry_run:
        print("bench_gpu.py needs a CUDA device; none is available", file=sys.stderr)
        return 2
    import triton

    dev = torch.device("cuda" if on_gpu() else "cpu")
    tokens = DRY_TOKENS if a.dry_run else TOKENS
    if a.dry_run:
        a.reps, a.warmup = 1, 0
    a.out = a.out or Path("out/bench_gpu-dry-run" if a.dry_run else "benchmarks/results")  # no dry run's
    a.out.mkdir(parents=True, exist_ok=True)  # figures among the results
    peak, bw = device_peaks(a.reps)
    meta = {"device": torch.cuda.get_device_name(dev) if on_gpu() else "cpu", "dry_run": a.dry_run,
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "peak_tflops": peak / 1e12, "copy_gbs": bw / 1e9, "machine": machine().to_json(),
            "tokens": tokens, "tiles": dataclasses.asdict(TILES), "command": " ".join(sys.argv)}
    rows: list[dict] = []
    details: dict[str, dict] = {}
    table = dry_shapes() if a.dry_run else shapes(dev)
    unknown = sorted(set(a.shapes or ()) - set(table))
    if unknown:
        print(f"bench_gpu.py: --shapes {unknown} are not among {list(table)}", file=sys.stderr)
        return 2
    for name in a.shapes or table:  # in the order asked: a limit cuts the last ones
        spec = table[name]
        for kind in map(RoutingKind, a.routing):
            try:
                rows += run_shape(name, spec, a.ep, a.reps, a.warmup, (peak, bw), a.out, details,
                                  persistent=not a.peers_only, kind=kind,
                                  layer_persistent=a.persistent_layer, tokens=tokens)
            except Exception:
                traceback.print_exc()
                rows.append({"shape": name, "experts": spec.experts, "ep": a.ep, "routing": kind.value,
                             "region": "-", "variant": "-", "ms": float("nan"), "tflops": float("nan"),
                             "roofline_fraction": float("nan"), "error": traceback.format_exc(limit=1)})
            torch.cuda.empty_cache()
            write(a.out, meta, rows, details)  # each shape's rows as soon as they are measured
    write(a.out, meta, rows, details)
    print(markdown(meta, rows))
    return 0


def write(out: Path, meta: dict, rows: list[dict], details: dict) -> None:
    """bench_gpu.json and bench_gpu.md under ``out``."""
    (out / "bench_gpu.json").write_text(json.dumps({"meta": meta, "rows": rows, "calibration": details},
                                                   indent=1, default=lambda o: getattr(o, "value", str(o))))
    (out / "bench_gpu.md").write_text(markdown(meta, rows))


if __name__ == "__main__":
    sys.exit(main())

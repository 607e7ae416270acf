"""``backend="triton"``: the forward and backward MoE regions as one persistent kernel each.

Plan of a call:
  1. plan the routing and lower the region to its task graph (every virtual rank);
  2. schedule it with the chosen policy on this device's workers (on a GPU: as many as
     can be resident, see ``residency``; in the interpreter: ``TritonOptions.workers``);
  3. pack the schedule into int32 arrays and lay every rank's buffers out in one arena;
  4. run the persistent kernel (``runner.DeviceProgram``) and read the outputs.

Outputs and work buffers start as NaN, so a row no task wrote shows in the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..spec import require_per_expert
from .buffers import Arena, BufferSpace, buffer_space
from .core import (
    BACKWARDS,
    DEFAULT_TILES,
    FORWARD,
    ExpertWeights,
    Gradients,
    HardwareModel,
    ParallelSpec,
    Routing,
    RoutingPlan,
    Schedule,
    SchedulePolicy,
    SlotGradients,
    TaskGraph,
    TileSpec,
    WorkerCounts,
    as_kept,
    check_input,
    hardware_preset,
    plan_routing,
)
from .ops import aligned_addresses, aligned_layout, describe
from .pack import pack
from .residency import check_resident
from .runner import DeviceProgram, KernelConfig, RunInfo, resident_per_rank
from .split import measured_schedule, run_ms, scheduled, split_key

INTERPRETER_WORKERS = WorkerCounts(matrix=2, vector=2)


@dataclass(frozen=True)
class TritonOptions:
    """How the triton backend runs a region.

    policy: the scheduling policy.  workers: queues per rank (None: on a GPU the most
    that stay resident, split by the cost model; in the interpreter 2 + 2).
    hardware: cost model of CRITICAL_PATH and of the worker split (None: ``h100``).
    config: tile sizes and launch options (None: the device's default).
    deadline_s: per-wait deadline on a GPU.  stamps: record per-task start/end."""

    policy: SchedulePolicy = SchedulePolicy.HYPERPARALLEL
    workers: WorkerCounts | None = None
    hardware: HardwareModel | None = None
    config: KernelConfig | None = None
    deadline_s: float = 10.0
    stamps: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.policy, SchedulePolicy):
            raise TypeError(f"TritonOptions.policy must be a SchedulePolicy, got {self.policy!r}")
        if self.workers is not None and not isinstance(self.workers, WorkerCounts):
            raise TypeError(f"TritonOptions.workers must be WorkerCounts, got {self.workers!r}")
        if not self.deadline_s > 0:
            raise ValueError(f"TritonOptions.deadline_s must be > 0, got {self.deadline_s!r}")


@dataclass
class PreparedRegion:
    """One region compiled for a device: its schedule, device program and arena.
    ``run()`` executes it again (its counters started from zero)."""

    schedule: Schedule
    program: DeviceProgram
    arena: Arena
    options: TritonOptions

    def run(self, delays_ns: np.ndarray | None = None) -> RunInfo:
        return self.program.run(self.arena.addresses(), deadline_s=self.options.deadline_s,
                                stamps=self.options.stamps, delays_ns=delays_ns)


def region_schedule(graph: TaskGraph, tasks: np.ndarray, options: TritonOptions, arena: Arena) -> Schedule:
    """Schedule ``graph`` (operand rows ``tasks``) on the device's workers (refusing more
    than can be resident): ``options.workers``, else on a GPU every resident program,
    split by measuring (``split.measured_schedule``), in the interpreter
    ``INTERPRETER_WORKERS``."""
    hw = options.hardware or hardware_preset("h100")
    workers = options.workers
    if arena.device.type == "cuda":
        aligned = aligned_layout(tasks, arena.space) and aligned_addresses(tasks, arena.host_addresses())
        per_rank = resident_per_rank(graph, arena.device, arena.dtype, options.config, aligned)
        if workers is None:
            key = split_key(graph, options.policy, arena.dtype, options.config, per_rank)
            return measured_schedule(graph, options.policy, hw, key, per_rank,
                                     lambda s: run_ms(s, arena, options.config, options.deadline_s))
        check_resident(graph.ep * workers.per_rank, graph.ep * per_rank)
    elif workers is None:
        workers = INTERPRETER_WORKERS
    return scheduled(graph, options.policy, hw, workers)


def prepare(graph: TaskGraph, arena: Arena, options: TritonOptions) -> PreparedRegion:
    tasks = describe(graph, arena.space)
    sched = region_schedule(graph, tasks, options, arena)
    program = DeviceProgram(pack(sched, arena.space, tasks), arena.device, arena.dtype, options.config)
    return PreparedRegion(schedule=sched, program=program, arena=arena, options=options)


# ---------------------------------------------------------------------------- forward

@dataclass
class TritonForward:
    """out: [N, H] spec.dtype.  region: the prepared forward region (its arena keeps
    what the backward region reads).  plan, tiles: as lowered.  info: the run."""

    out: torch.Tensor
    region: PreparedRegion
    plan: RoutingPlan
    tiles: TileSpec
    weights: ExpertWeights
    routing: Routing
    x: torch.Tensor
    info: RunInfo


def forward_arena(x: torch.Tensor, weights: ExpertWeights, routing: Routing, plan: RoutingPlan,
                  space: BufferSpace) -> Arena:
    """The arena of a forward call: work buffers NaN, caller tensors bound (the expert
    weights where they are stored, ``bind_experts``), indices filled."""
    spec = weights.spec
    arena = Arena(space, spec.dtype, x.device)
    bind = {"x": x.contiguous(), "topk": routing.weights.to(x.device, torch.float32).contiguous(),
            "out": torch.full_like(x, float("nan"))}
    if weights.has_shared:
        bind.update(sw13=weights.shared_w13.contiguous(), sw2=weights.shared_w2.contiguous())
    arena.bind_all(bind)
    bind_experts(arena, {"w13": weights.w13.contiguous(), "w2": weights.w2.contiguous()}, weights)
    fill_indices(arena, plan, routing.weights)
    return arena


def bind_experts(arena: Arena, tensors: dict[str, torch.Tensor], weights: ExpertWeights) -> None:
    """Bind expert-row tensors ([R, ...] stored rows, or their gradients): split over the
    ranks, or under slot rows every rank the whole tensor (``BufferSpace.read``)."""
    for name, t in tensors.items():
        if weights.slot_rows is None:
            arena.bind(name, t)
        else:
            arena.bind_shared(name, t)


def region_space(plan: RoutingPlan, weights: ExpertWeights) -> BufferSpace:
    """``buffer_space`` of ``plan`` with the experts' slot rows (each its own without)."""
    return buffer_space(plan, weights.slot_rows, weights.w13.shape[0])


def fill_indices(arena: Arena, plan: RoutingPlan, topk_weights: torch.Tensor) -> None:
    """Every rank's int32 row indices (token of each permuted row, permuted row of each
    (token, slot)) and float32 routing weight of each permuted row, from the plan."""
    k = plan.moe.top_k
    flat_w = topk_weights.to(arena.device, torch.float32).reshape(plan.par.ep, -1)
    for r in range(plan.par.ep):
        order = plan.order[r].to(arena.device)
        arena.rank_view("tok", r).copy_((order // k).view(-1, 1))
        arena.rank_view("pos", r).copy_(plan.pos[r])
        arena.rank_view("roww", r).copy_(flat_w[r][order].view(-1, 1))


def triton_forward(x: torch.Tensor, weights: ExpertWeights, routing: Routing, ep: int = 1,
                   tiles: TileSpec = DEFAULT_TILES, options: TritonOptions | None = None,
                   checked: bool = False) -> TritonForward:
    """The forward MoE region of ``ep`` virtual ranks as one persistent kernel on
    ``x.device`` (a CUDA device, or the CPU through the Triton interpreter).

    x: [N, H] spec.dtype; weights and routing on the same device.  Returns the output
    [N, H] spec.dtype and what the backward region needs.  checked: the caller has
    checked x and routing (``routing.check_input``)."""
    options = options or TritonOptions()
    spec = weights.spec
    if not checked:
        check_input(x, routing, spec)
    if not isinstance(ep, int) or ep <= 0 or x.shape[0] % ep:
        raise ValueError(f"ep={ep!r} must be a positive int dividing the {x.shape[0]} tokens")
    require_per_expert(tiles, "the triton backend (no device operations for EXPAND, PARTIAL_REDUCE, "
                              "PARTIAL_SUM)")
    if spec.expert_bias or not spec.glu.plain:
        raise ValueError(f"backend='triton' computes act(gate) * up without expert biases; got "
                         f"MoESpec.expert_bias={spec.expert_bias}, MoESpec.glu={spec.glu} (GPT-OSS's "
                         "experts run on the exact and runtime backends)")
    par = ParallelSpec(ep=ep, tokens_per_rank=x.shape[0] // ep)
    plan = plan_routing(routing.ids.cpu(), spec, par, checked)
    arena = forward_arena(x, weights, routing, plan, region_space(plan, weights))
    region = prepare(FORWARD.graph(plan, tiles), arena, options)
    info = region.run()
    return TritonForward(out=arena.gather("out"), region=region, plan=plan, tiles=tiles, weights=weights,
                         routing=routing, x=x, info=info)


# ---------------------------------------------------------------------------- backward

@dataclass
class TritonGradients:
    """The gradients and the backward run."""

    grads: Gradients
    region: PreparedRegion
    info: RunInfo


def triton_backward(fwd: TritonForward, dy: torch.Tensor, recompute: bool = False,
                    options: TritonOptions | None = None) -> TritonGradients:
    """The backward region after ``fwd``: dy [N, H] spec.dtype on the forward's device.

    Expert weight gradients of experts that received no rows are zero (no task
    writes them); every other output starts as NaN.  Under slot rows the expert
    gradients are shaped like the stored tensors, replicas summed (``SlotGradients``)."""
    options = options or fwd.region.options
    w, plan, arena = fwd.weights, fwd.plan, fwd.region.arena
    if dy.shape != fwd.x.shape or dy.dtype != fwd.x.dtype or dy.device != fwd.x.device:
        raise ValueError(f"dy must be {tuple(fwd.x.shape)} {fwd.x.dtype} on {fwd.x.device}, got "
                         f"{tuple(dy.shape)} {dy.dtype} on {dy.device}")
    k = w.spec.top_k
    nan = float("nan")
    out = {"dy": dy.contiguous(), "dx": torch.full_like(dy, nan),
           "dweights": torch.full((dy.shape[0], k), nan, device=dy.device)}
    arena.bind_all(out)
    slots = SlotGradients.of(w, slice(None), fill=nan)
    bind_experts(arena, slots.full, w)
    if w.slot_rows is not None:  # later replicas' gradients, folded in below
        for name, t in slots.scratch.items():
            arena.bind_shared(f"{name}x", t)
    if w.has_shared:
        for name in ("dsw13", "dsw2"):
            for r in range(plan.par.ep):
                arena.rank_view(name, r).fill_(nan)
    region = prepare(BACKWARDS[as_kept(recompute)].graph(plan, fwd.tiles), arena, options)
    info = region.run()
    slots.zero_idle((plan.counts.sum(dim=0).reshape(-1) > 0).tolist())  # experts without rows: no task
    slots.fold()
    grads = Gradients(dx=out["dx"], dweights=out["dweights"], dw13=slots.full["dw13"], dw2=slots.full["dw2"],
                      dshared_w13=_rank_sum(arena, "dsw13", w), dshared_w2=_rank_sum(arena, "dsw2", w))
    return TritonGradients(grads=grads, region=region, info=info)


def _rank_sum(arena: Arena, name: str, weights: ExpertWeights) -> torch.Tensor | None:
    """A shared-expert gradient summed over ranks in rank order in fp32."""
    if not weights.has_shared:
        return None
    acc = torch.zeros(arena.rank_view(name, 0).shape, device=arena.device)
    for r in range(arena.space.ep):
        acc += arena.rank_view(name, r).float()
    return acc.to(weights.spec.dtype)

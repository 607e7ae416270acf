"""The ways to run one region call, behind one protocol (``RegionPath``), and the one
autograd node that runs any of them (``RegionFunction``).

A path's ``forward(x, routing, weights, save)`` returns the output and, when ``save``,
the state its ``backward(state, dy)`` reads; a state's ``pack()`` hands every tensor it
holds to ``ctx.save_for_backward`` (so saved-tensor hooks such as non-reentrant
checkpointing see them) and ``unpack`` puts them back.

- ``ExactPath``: the taskflow of ``ep`` virtual ranks in one process (the exact
  executors, any valid task order);
- ``RuntimePath``: this rank's part of the taskflow on the multi-rank runtime;
- ``TritonPath``: the taskflow as one persistent Triton kernel on the input's device
  (from a program made once per shape and kept in the layer's pool, where one serves);
- ``KernelByKernelPath``: the region without tiles (grouped GEMMs, all-to-all).

Every path takes a call whose input has been checked and, on an EP group, agreed
(``engine.door``): none checks, agrees or counts on its own.  The backward node opens
the backward call's agreement (``RegionFunction.backward``) before the path runs."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from ..exec.arena import ArenaPool
from ..exec.exact import Order, execute_forward
from ..exec.exact_backward import Gradients, execute_backward
from ..exec.kernel_by_kernel import KernelByKernelState, kbk_backward, kbk_forward
from ..exec.phases import TORCH, Phases
from ..ir.schedule import SchedulePolicy
from ..regions.backward_kernels import SavedActivations
from ..regions.base import Kept, RegionKind
from ..regions.family import region_family
from ..routing import Routing, RoutingPlan, bare
from ..schedule.tuner import Trial, timed
from ..sim.hardware import HardwareModel
from ..spec import MoESpec, Recompute, TileSpec
from ..weights import ExpertWeights
from . import offload

if TYPE_CHECKING:
    from ..gpu.slots import SlotLaunch, SlotProgram
    from ..runtime import ForwardOptions, Session


class PathState(Protocol):
    def pack(self) -> tuple[list[torch.Tensor | None], PathState]: ...

    def unpack(self, tensors: tuple[torch.Tensor | None, ...]) -> PathState: ...

    def activations(self) -> tuple[int, ...]:
        """The places among ``pack``'s tensors of the activations the call keeps (what
        ``offload`` sends to host memory): all but the layer input, the routing and the
        weights."""
        ...


class RegionPath(Protocol):
    """One way to run the region.  ``reads_slots``: its forward takes weights whose
    experts read rows in place (``ExpertWeights.slot_rows``); the others are given
    gathered ones."""

    reads_slots: ClassVar[bool]

    def forward(self, x: torch.Tensor, routing: Routing, weights: ExpertWeights,
                save: bool) -> tuple[torch.Tensor, PathState | None]: ...

    def backward(self, state: Any, dy: torch.Tensor) -> Gradients: ...


@dataclass
class RegionState:
    """What a taskflow's backward reads: the plan, per (virtual or local) rank the saved
    activations (``SavedActivations``, in either dispatch mode), the detached weights and
    the routing the contexts are built from (ids and top-k weights [N, k] float32: this
    rank's, or every rank's under deduplicated tiles on the runtime, whose receivers
    weigh rows)."""

    plan: RoutingPlan
    saved: list
    weights: ExpertWeights | None
    routing: Routing | None
    nbytes: int = 0
    slot_rows: tuple[int, ...] | None = None  # the weights' while they are packed away

    def saved_bytes(self) -> int:
        """Bytes of the saved activations (the input x excluded)."""
        return self.nbytes or sum(s.nbytes() for s in self.saved)

    def pack(self) -> tuple[list[torch.Tensor | None], RegionState]:
        """Every tensor of the state and the state without them."""
        w = self.weights
        tensors = [getattr(s, f.name) for s in self.saved for f in fields(s)]
        tensors += [w.router, w.router_bias, w.w13, w.w2, w.shared_w13, w.shared_w2, w.b13, w.b2,
                    self.routing.ids, self.routing.weights]
        bare = replace(self, saved=[None] * len(self.saved), weights=None, routing=None,
                       nbytes=self.saved_bytes(), slot_rows=w.slot_rows)
        return tensors, bare

    def activations(self) -> tuple[int, ...]:
        names = [f.name for f in fields(SavedActivations)]
        mine = [i for i, n in enumerate(names) if n != "x"]  # the layer input is the caller's
        return tuple(r * len(names) + i for r in range(len(self.saved)) for i in mine)

    def unpack(self, tensors: tuple[torch.Tensor | None, ...]) -> RegionState:
        """The inverse of ``pack``: this bare state with ``tensors`` put back."""
        n, ranks = len(fields(SavedActivations)), len(self.saved)
        saved = [SavedActivations(*tensors[r * n:(r + 1) * n]) for r in range(ranks)]
        *weight_tensors, ids, topk = tensors[ranks * n:]
        weights = ExpertWeights(self.plan.moe, *weight_tensors, slot_rows=self.slot_rows)
        return replace(self, saved=saved, weights=weights, routing=Routing(ids, topk))


def taskflow_kept(recompute: Recompute, group: bool) -> Kept:
    """What a taskflow's backward finds kept under ``recompute``, as kernel by kernel
    keeps it: NOTHING keeps everything; otherwise the shared activation is recomputed and
    the experts' input rows travel again beside their dy rows, in one process always, on
    an EP group (``group``) only under GEMM (the doubled backward dispatch crosses the
    link: 4-7% of a CPU step on 2 ranks over loopback, 12-17% over 2 Gbit/s, measured on
    kernel by kernel)."""
    if recompute is Recompute.NOTHING:
        return Kept.ALL
    return Kept.INPUT if recompute is Recompute.GEMM or not group else Kept.ROWS


@dataclass(frozen=True)
class ExactPath:
    """``ep`` virtual ranks in one process; ``order``: None (task-id order), a seed of a
    random valid order, or task ids (every order gives the same bits)."""

    reads_slots: ClassVar[bool] = True

    ep: int
    tiles: TileSpec
    order: Order = None
    nodes: int = 1
    recompute: Recompute = Recompute.PERMUTATION

    def forward(self, x: torch.Tensor, routing: Routing, weights: ExpertWeights,
                save: bool) -> tuple[torch.Tensor, RegionState | None]:
        fwd = execute_forward(x, weights, routing, self.ep, self.tiles, self.order, self.nodes, checked=True)
        if not save:
            return fwd.out, None
        family = region_family(self.tiles)
        saved = [family.saved(b, taskflow_kept(self.recompute, False)) for b in fwd.buffers]
        return fwd.out, RegionState(fwd.plan, saved, weights, routing)

    def backward(self, state: RegionState, dy: torch.Tensor) -> Gradients:
        return execute_backward(state.saved, state.plan, dy, state.weights, state.routing, self.tiles,
                                taskflow_kept(self.recompute, False), self.order).grads


@dataclass(frozen=True)
class RuntimePath:
    """This rank's part of the taskflow on the runtime of ``session``, scheduled by
    ``policy`` on ``hardware``'s workers.  Expert gradients are full-size [E, ...] with
    this rank's experts filled in and zeros elsewhere."""

    reads_slots: ClassVar[bool] = True

    session: Session
    tiles: TileSpec
    policy: SchedulePolicy
    hardware: HardwareModel
    nodes: int = 1
    recompute: Recompute = Recompute.PERMUTATION

    def options(self) -> ForwardOptions:
        from ..runtime import ForwardOptions

        return ForwardOptions(tiles=self.tiles, policy=self.policy, hardware=self.hardware, nodes=self.nodes)

    def forward(self, x: torch.Tensor, routing: Routing, weights: ExpertWeights,
                save: bool) -> tuple[torch.Tensor, RegionState | None]:
        from ..runtime import ForwardRunner

        fwd = ForwardRunner(self.session, weights, self.options())(x, routing, agreed=True)
        if not save:
            return fwd.out, None
        family = region_family(self.tiles)
        saved = family.saved(fwd.buffers, taskflow_kept(self.recompute, True), symmetric=True)
        return fwd.out, RegionState(fwd.plan, [saved], weights, fwd.routing)

    def backward(self, state: RegionState, dy: torch.Tensor) -> Gradients:
        from ..runtime import run_backward

        return run_backward(self.session, state.plan, state.saved[0], dy, state.weights, state.routing,
                            self.options(), taskflow_kept(self.recompute, True), agreed=True).grads


class _InArena:
    """A state whose tensors live in its program's arena: it hands autograd none."""

    def pack(self) -> tuple[list[torch.Tensor | None], _InArena]:
        return [], self

    def unpack(self, tensors: tuple[torch.Tensor | None, ...]) -> _InArena:
        return self

    def activations(self) -> tuple[int, ...]:
        return ()


@dataclass
class TritonState(_InArena):
    """The triton forward (its arena holds the saved activations)."""

    forward: Any


@dataclass
class SlotState(_InArena):
    """A forward of a per-shape program (``gpu.slots.SlotProgram``), whose one arena holds
    the activations of its last forward only: the backward of an earlier call (two in
    flight: micro-batches before their backwards, a checkpoint's recompute) runs this
    call's forward again first, with the same bits."""

    program: SlotProgram
    run: SlotLaunch
    x: torch.Tensor
    weights: ExpertWeights
    routing: Routing

    def backward(self, dy: torch.Tensor) -> Gradients:
        p = self.program
        run = self.run if p.last is self.run else p.launch(self.x, self.weights, self.routing)
        return p.launch_backward(run, dy, self.weights, self.routing).grads


@dataclass(frozen=True)
class TritonPath:
    """One persistent Triton kernel per region on the input's device (``hpmoe.gpu``).
    With a ``pool`` (the layer's), a call that a per-shape program serves
    (``gpu.slots.per_shape``: one rank, per-expert dispatch, no expert biases) runs the
    program kept there for its shape, made once and bound to each new routing on the
    device and launched without a host sync (a late wait of a launch is raised at the
    program's next launch, or by ``MoE.check``); other calls plan their routing on the
    host (``gpu.backend``) and are checked at once.  The program keeps its activations
    (``recompute`` applies to the per-routing kernels)."""

    reads_slots: ClassVar[bool] = True

    ep: int
    tiles: TileSpec
    policy: SchedulePolicy = SchedulePolicy.HYPERPARALLEL
    hardware: HardwareModel | None = None
    recompute: Recompute = Recompute.PERMUTATION
    pool: ArenaPool | None = field(default=None, compare=False)

    def forward(self, x: torch.Tensor, routing: Routing, weights: ExpertWeights,
                save: bool) -> tuple[torch.Tensor, TritonState | SlotState | None]:
        from ..gpu.backend import TritonOptions, triton_forward
        from ..gpu.slots import PlanCache, per_shape

        options = TritonOptions(self.policy, hardware=self.hardware)
        if self.pool is not None and per_shape(weights.spec, self.ep, self.tiles):
            plans = self.pool.resident(PlanCache, PlanCache)
            program = plans.program(x, weights, routing, self.tiles, options)
            run = program.launch(x, weights, routing)  # no host sync: a late wait is raised one call late
            return run.out, SlotState(program, run, x, weights, routing) if save else None
        fwd = triton_forward(x, weights, routing, self.ep, self.tiles, options, checked=True)
        return fwd.out, TritonState(fwd) if save else None

    def backward(self, state: TritonState | SlotState, dy: torch.Tensor) -> Gradients:
        from ..gpu.backend import triton_backward

        if isinstance(state, SlotState):
            return state.backward(dy)
        return triton_backward(state.forward, dy, self.recompute.activation).grads


@dataclass(frozen=True)
class KernelByKernelPath:
    """The region without tiles (``exec.kernel_by_kernel``): in one process, or over the
    EP group of ``session`` (its deadline-bounded collectives); scratch from ``pool``;
    ``received``: this call's rows from each rank for this rank's experts, carried by
    the call's agreement (None: the forward exchanges them); ``phases``: the functions of
    its memory-bound phases (``exec.phases``)."""

    reads_slots: ClassVar[bool] = True

    session: Session | None = None
    tiles: TileSpec | None = None  # fingerprinted in the backward's agreement
    pool: ArenaPool | None = None
    recompute: Recompute = Recompute.PERMUTATION
    received: torch.Tensor | None = field(default=None, compare=False)
    phases: Phases = TORCH

    def forward(self, x: torch.Tensor, routing: Routing, weights: ExpertWeights,
                save: bool) -> tuple[torch.Tensor, KernelByKernelState | None]:
        coll = self.session.collectives if self.session is not None else None
        return kbk_forward(x, routing, weights, coll, self.pool, save, self.recompute, self.received,
                           checked=True, phases=self.phases)

    def backward(self, state: KernelByKernelState, dy: torch.Tensor) -> Gradients:
        return kbk_backward(state, dy, self.pool)


# ---------------------------------------------------------------------------- autograd

CLOCK_DECAY = 0.9  # of a layer's measured seconds per region call, per call


@dataclass
class RegionClock:
    """A layer's measured wall seconds per region call: moving averages of its forwards
    and of its backwards (``CLOCK_DECAY`` per call; the first call sets each)."""

    forward_s: float = 0.0
    backward_s: float = 0.0

    def add(self, backward: bool, seconds: float) -> None:
        name = "backward_s" if backward else "forward_s"
        last = getattr(self, name)
        setattr(self, name, seconds if last == 0.0 else CLOCK_DECAY * last + (1.0 - CLOCK_DECAY) * seconds)

    @property
    def call_s(self) -> float:
        """Seconds of one training call (forward and backward)."""
        return self.forward_s + self.backward_s


@contextmanager
def clocked(clock: RegionClock | None, backward: bool) -> Iterator[None]:
    """Add the block's wall seconds to ``clock`` (None: nothing)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if clock is not None:
            clock.add(backward, time.perf_counter() - t0)


def _timing(trial: Trial | None, clock: RegionClock | None, device: torch.device,
            backward: bool) -> contextlib.AbstractContextManager:
    """The block timed for a tuning ``trial`` and for ``clock``; where neither times it,
    nothing to enter (two generator contexts are a tiny call's host time)."""
    if clock is None and (trial is None or not trial.tuning):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(timed(trial, device))
    stack.enter_context(clocked(clock, backward))
    return stack


@dataclass(frozen=True)
class RegionCall:
    """Non-tensor inputs of one region call: the spec (dtype: the compute dtype), ids
    [N, k] int64 expert ids of the local tokens, the path, whether grad mode was on at the
    call (inside ``forward`` it is always off, and ``ctx.needs_input_grad`` ignores it:
    without this an inference call would save activations), the tuner's trial and the
    layer's clock (the backward's seconds go into both); on an EP group the session
    whose agreement opens the backward call, and the tiles it fingerprints; ``counts``:
    the rows per expert of ``ids`` where the call's scan counted them (None: the path
    counts); ``offload``: the activations it keeps wait in host memory for the backward
    (``engine.offload``)."""

    spec: MoESpec
    ids: torch.Tensor
    path: RegionPath
    grad: bool = True
    trial: Trial | None = None
    slot_rows: tuple[int, ...] | None = None
    clock: RegionClock | None = None
    session: Session | None = None
    tiles: TileSpec | None = None
    counts: torch.Tensor | None = None
    offload: bool = False


class RegionFunction(torch.autograd.Function):
    """The region as one autograd node, on any path.  Inputs: x [N, H] spec.dtype,
    routing weights [N, k] float32, w13 [E, 2F, H], w2 [E, H, F], shared_w13 [2Fs, H] |
    None, shared_w2 [H, Fs] | None, b13 [E, 2F] | None, b2 [E, H] | None, the shared
    expert's gate and up [Fs, H] whose concatenation shared_w13 is (or None, None), a
    ``RegionCall``.  Output: [N, H] spec.dtype.  Given gate and up, the node keeps them
    (the model's own parameters) instead of the call's fused copy, and fuses them again
    in its backward; their gradients flow through shared_w13's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: torch.Tensor, *tensors: Any) -> torch.Tensor:
        *weight_tensors, gate, up, call = tensors
        weights = ExpertWeights.routed(call.spec, *(t if t is None else t.detach() for t in weight_tensors),
                                       slot_rows=call.slot_rows, checked=True)
        x, routing = _detached(x, Routing(call.ids, topk_weights, call.counts))
        save = call.grad and any(ctx.needs_input_grad[:-1])
        out, state = call.path.forward(x, routing, weights, save)
        if state is not None:
            tensors, ctx.state = state.pack()
            ctx.fused = _refused(tensors, weights.shared_w13) if gate is not None else ()
            ctx.parcel = offload.send(tensors, state.activations()) if call.offload else None
            ctx.save_for_backward(*tensors, *((gate.detach(), up.detach()) if ctx.fused else ()))
            ctx.call = call
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        call: RegionCall = ctx.call
        if ctx.state is None:
            raise RuntimeError("Trying to backward through an hpmoe region a second time: the persistent "
                               "kernel's state goes with its first backward (retain_graph=True is not "
                               "supported with backend='triton')")
        tensors = list(ctx.saved_tensors)  # the usual error where autograd freed them (no retain_graph)
        if ctx.fused:
            parts = torch.cat(tensors[-2:])
            del tensors[-2:]
            for i in ctx.fused:
                tensors[i] = parts
        offload.receive(tensors, ctx.parcel)
        state = ctx.state.unpack(tensors)
        if isinstance(state, _InArena):  # it holds its buffers itself: they go as saved tensors would
            ctx.state = None
        dy = dout.to(call.spec.dtype).contiguous()
        with _timing(call.trial, call.clock, dy.device, backward=True):
            if call.session is not None:  # ranks in step on the region, not on dy's values (an inf
                # gradient reaches a loss scaler)
                call.session.open_call(RegionKind.BACKWARD, state.weights, call.tiles, dy.shape[0])
            g = call.path.backward(state, dy)
        return g.dx, g.dweights, *g.expert_tensors, None, None, None


def _refused(tensors: list[torch.Tensor | None], fused: torch.Tensor | None) -> tuple[int, ...]:
    """The places of ``fused`` (the shared expert's fused gate/up) among a state's
    ``tensors``, set to None there: the node keeps its parts instead."""
    places = tuple(i for i, t in enumerate(tensors) if fused is not None and t is fused)
    for i in places:
        tensors[i] = None
    return places


def run(path: RegionPath, x: torch.Tensor, routing: Routing, weights: ExpertWeights,
        trial: Trial | None = None, own: slice | None = None, clock: RegionClock | None = None,
        session: Session | None = None, tiles: TileSpec | None = None, offload: bool = False) -> torch.Tensor:
    """The region on ``path`` as one autograd node (gradients flow to x, the routing
    weights and every expert tensor); a tuning ``trial`` and a ``clock`` are timed
    forward and backward; ``session``: an EP group's, whose agreement opens the
    backward (``tiles``: fingerprinted).  Weights whose experts read slot rows are
    gathered first for a path that reads none (``own``: the only experts it reads, the
    others left unfilled; None: every one).  ``offload``: ``RegionCall.offload``."""
    w = weights if path.reads_slots else weights.gathered(own)
    tensors = (w.w13, w.w2, w.shared_w13, w.shared_w2, w.b13, w.b2)
    with _timing(trial, clock, x.device, backward=False):
        if not records_backward(x, routing.weights, w):
            # no autograd node: its apply is a tiny call's largest host cost
            return path.forward(*_detached(x, routing), w.detached(), False)[0]
        call = RegionCall(w.spec, routing.ids, path, True, trial, w.slot_rows, clock, session, tiles,
                          routing.counts, offload)
        return RegionFunction.apply(x, routing.weights, *tensors, *(w.shared_parts or (None, None)), call)


def _detached(x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Routing]:
    """The call's x and routing weights detached, as a path computes on them (with its
    weights' tensors detached too): the runtime's worker threads run with grad mode on
    (it is per thread)."""
    return bare(x), Routing(routing.ids, bare(routing.weights), routing.counts)


def records_backward(x: torch.Tensor, topk_weights: torch.Tensor, w: ExpertWeights) -> bool:
    """Whether a call on x, its routing weights and expert weights ``w`` records a
    backward (one autograd node): grad mode on and one of them requires a gradient."""
    tensors = (x, topk_weights, w.w13, w.w2, w.shared_w13, w.shared_w2, w.b13, w.b2, *(w.shared_parts or ()))
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

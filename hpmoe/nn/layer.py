"""``hpmoe.MoE``: an ``nn.Module`` whose MoE-FFN region runs as tile taskflows.

Routing (the gate) runs in ordinary autograd; the region — dispatch, expert GEMMs and
SwiGLU, combine, shared experts — runs through ``MoEFunction``: the forward taskflow
keeps minimal activations (``SavedActivations``), the backward taskflow returns the
gradients of the input, of the routing weights (autograd carries them on to the
router), of the expert weights and of the shared-expert weights.

Parameters carry transformers' names (``gate.weight``, ``gate.e_score_correction_bias``,
``experts.gate_up_proj``, ``experts.down_proj``, ``shared_experts.{gate,up,down}_proj``),
so state dicts line up with ``DeepseekV3MoE`` / ``Qwen3MoeSparseMoeBlock``.

Execution:
  * single process: ``virtual_ep`` ranks (default 1) through the exact executors;
  * ``ep_group``: one EP rank per process of a torch.distributed group (any subgroup),
    on the multi-rank runtime (``hpmoe.runtime``: worker threads walking the queues of a
    ``SchedulePolicy``, one-sided puts over shared memory or torch.distributed; the
    forward region is the runtime's ``ForwardRunner``, the backward one ``BACKWARD``).
    Each rank holds its own tokens; expert ``e`` runs on rank ``e // (E / ep)``.  Every
    rank keeps full-size parameter tensors (state dicts stay those of transformers);
    expert gradients are complete on the owning rank and zero elsewhere, gradients of
    replicated parameters (router, shared experts) are this rank's share — all-reduce
    every gradient over the group (or wrap the model in DDP) as for data parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..exec.backend import Backend, as_backend
from ..exec.exact import DEFAULT_TILES, execute_forward
from ..exec.exact_backward import Gradients, execute_backward
from ..exec.program import RankProgram, compile_program, compile_region
from ..regions.backward_kernels import (
    BACKWARD,
    BACKWARD_RECOMPUTE,
    BackwardBuffers,
    BackwardContext,
    SavedActivations,
)
from ..regions.base import Region
from ..routing import Routing, RoutingPlan, route
from ..schedule.base import Schedule, SchedulePolicy
from ..sim.hardware import HardwareModel, cpu_nominal
from ..spec import GateKind, MoESpec, TileSpec
from ..weights import ExpertWeights

if TYPE_CHECKING:  # the runtime is imported on first distributed use, never by ``import hpmoe``
    from ..runtime import RuntimeConfig, Session

# ---------------------------------------------------------------------------- parameters


class TopkRouter(nn.Module):
    """``gate``: weight [E, H] (float32 unless the model was cast) and, for sigmoid
    gates, the ``e_score_correction_bias`` [E] float32 buffer."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = _param(weight)
        if bias is not None:
            self.register_buffer("e_score_correction_bias", bias)


class FusedExperts(nn.Module):
    """``experts``: gate_up_proj [E, 2F, H] (gate rows [0, F), up rows [F, 2F)) and
    down_proj [E, H, F], as transformers stores them."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor):
        super().__init__()
        self.gate_up_proj = _param(gate_up_proj)
        self.down_proj = _param(down_proj)


class SharedMLP(nn.Module):
    """``shared_experts``: bias-free gate_proj, up_proj ([Fs, H]) and down_proj ([H, Fs])."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (_linear(w) for w in (gate, up, down))


def _param(t: torch.Tensor) -> nn.Parameter:
    """``t`` itself when it already is a Parameter (keeps a model's tensors), else a new one."""
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t)


def _linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = _param(weight)
    return lin


# ---------------------------------------------------------------------------- options


@dataclass(frozen=True)
class RegionOptions:
    """How the region runs.

    ep_group: None (one process); a torch.distributed process group of the EP ranks
      (the layer opens a runtime ``Session`` on it at its first forward, configured by
      ``runtime``); or a runtime ``Session`` shared between layers.
    virtual_ep: EP ranks simulated in one process (must be 1 with an ep_group).
    schedule: with an ep_group, the runtime's ``SchedulePolicy`` (None: HYPERPARALLEL);
      in one process, the exact executors' task order: None (task-id order) or an int
      seeding a random valid order — every order gives the same bits.
    recompute: recompute the SwiGLU activations in backward instead of saving them.
    tiles: the tiling.  runtime: ``RuntimeConfig`` of the session the layer opens.
    hardware: the cost model of the CRITICAL_PATH scheduler.
    backend: in one process, ``"exact"`` (torch kernels) or ``"triton"`` (each region one
      persistent Triton kernel on the input's device; ``schedule`` is then a
      ``SchedulePolicy`` or None for HYPERPARALLEL).
    """

    ep_group: Any = None
    virtual_ep: int = 1
    schedule: SchedulePolicy | int | None = None
    recompute: bool = False
    tiles: TileSpec = DEFAULT_TILES
    runtime: RuntimeConfig | None = None
    hardware: HardwareModel | None = None
    backend: Backend | str = Backend.EXACT

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", as_backend(self.backend))
        if not isinstance(self.virtual_ep, int) or isinstance(self.virtual_ep, bool) or self.virtual_ep <= 0:
            raise ValueError(f"virtual_ep must be a positive int, got {self.virtual_ep!r}")
        if not isinstance(self.recompute, bool):
            raise TypeError(f"recompute must be a bool, got {self.recompute!r}")
        if not isinstance(self.tiles, TileSpec):
            raise TypeError(f"tiles must be a TileSpec, got {type(self.tiles).__name__}")
        if self.runtime is not None:
            from ..runtime import RuntimeConfig

            if not isinstance(self.runtime, RuntimeConfig):
                raise TypeError(f"runtime must be a RuntimeConfig, got {type(self.runtime).__name__}")
        if self.hardware is not None and not isinstance(self.hardware, HardwareModel):
            raise TypeError(f"hardware must be a HardwareModel, got {type(self.hardware).__name__}")
        if self.distributed:
            self._check_distributed()
        else:
            self._check_single_process()

    def _check_distributed(self) -> None:
        if self.backend is not Backend.EXACT:
            raise ValueError(f"backend={self.backend.value!r} runs in one process, without an ep_group")
        if self.virtual_ep != 1:
            raise ValueError(f"virtual_ep={self.virtual_ep} cannot be combined with an ep_group")
        if self.schedule is not None and not isinstance(self.schedule, SchedulePolicy):
            raise ValueError(f"schedule={self.schedule!r}: with an ep_group, schedule is a SchedulePolicy")
        if self.session is not None and self.runtime is not None:
            raise ValueError("runtime configures a session the layer opens; ep_group is already a Session")

    def _check_single_process(self) -> None:
        if self.backend is Backend.TRITON:
            if self.schedule is not None and not isinstance(self.schedule, SchedulePolicy):
                raise ValueError(f"schedule={self.schedule!r}: the triton backend takes a SchedulePolicy")
            if self.runtime is not None:
                raise ValueError("runtime configures the multi-rank runtime, not the triton backend")
            return
        seed = isinstance(self.schedule, int) and not isinstance(self.schedule, bool)
        if self.schedule is not None and not seed:
            raise ValueError(f"schedule={self.schedule!r}: in one process, schedule is None or an int "
                             "seed (scheduling policies need an ep_group)")
        if self.runtime is not None or self.hardware is not None:
            raise ValueError("runtime and hardware configure the runtime: they need an ep_group")

    @property
    def distributed(self) -> bool:
        return self.ep_group is not None

    @property
    def session(self) -> Session | None:
        """``ep_group`` when it is a runtime ``Session`` shared between layers."""
        if not self.distributed:
            return None
        from ..runtime import Session

        return self.ep_group if isinstance(self.ep_group, Session) else None

    @property
    def rank_hardware(self) -> HardwareModel:
        """The rank's hardware model on the runtime (default ``cpu_nominal()``)."""
        return self.hardware if self.hardware is not None else cpu_nominal()

    @property
    def policy(self) -> SchedulePolicy:
        """The runtime's scheduling policy (distributed runs)."""
        return self.schedule if isinstance(self.schedule, SchedulePolicy) else SchedulePolicy.HYPERPARALLEL


# ---------------------------------------------------------------------------- module


class MoE(nn.Module):
    """A routed + shared MoE-FFN layer whose region runs as tile taskflows.

    spec: the layer shape (``spec.dtype`` is the dtype of inputs and expert weights);
    weights: initial parameters (copied), or None for ``ExpertWeights.random(spec, seed)``.
    The other arguments are the fields of ``RegionOptions``.
    forward: hidden_states [..., H] spec.dtype -> [..., H] spec.dtype; with an ep_group,
    this rank's tokens (every rank of the group the same number).
    """

    def __init__(self, spec: MoESpec, weights: ExpertWeights | None = None, *, ep_group: Any = None,
                 schedule: SchedulePolicy | int | None = None, recompute: bool = False,
                 virtual_ep: int = 1, tiles: TileSpec = DEFAULT_TILES, runtime: RuntimeConfig | None = None,
                 hardware: HardwareModel | None = None, seed: int = 0, backend: Backend | str = "exact"):
        super().__init__()
        if not isinstance(spec, MoESpec):
            raise TypeError(f"spec must be a MoESpec, got {type(spec).__name__}")
        w = ExpertWeights.random(spec, seed) if weights is None else weights
        if not isinstance(w, ExpertWeights) or w.spec != spec:
            raise ValueError(f"weights must be ExpertWeights of spec {spec}, got {getattr(w, 'spec', w)!r}")
        fs = spec.shared_ffn
        bias = w.router_bias.detach().clone() if spec.gate is GateKind.SIGMOID else None
        parts = (w.shared_w13[:fs], w.shared_w13[fs:], w.shared_w2) if fs else ()
        shared = SharedMLP(*(t.detach().clone() for t in parts)) if fs else None
        self._setup(spec, TopkRouter(w.router.detach().clone(), bias),
                    FusedExperts(w.w13.detach().clone(), w.w2.detach().clone()), shared,
                    RegionOptions(ep_group, virtual_ep, schedule, recompute, tiles, runtime, hardware,
                                  backend))

    def _setup(self, spec: MoESpec, gate: nn.Module, experts: nn.Module, shared: nn.Module | None,
               options: RegionOptions) -> None:
        self.spec = spec
        self.options = options
        self.experts = experts  # transformers' registration order: experts, gate, shared_experts
        self.gate = gate
        self.shared_experts = shared
        self._session = options.session
        self._owns_session = False

    @classmethod
    def from_hf(cls, module: nn.Module, **options: Any) -> MoE:
        """An hpmoe layer over the very parameters of a transformers ``DeepseekV3MoE`` or
        ``Qwen3MoeSparseMoeBlock``: ``gate``, ``experts`` and ``shared_experts`` are that
        module's submodules, so parameter objects, names and buffers are unchanged.
        ``options``: fields of ``RegionOptions`` (ep_group, schedule, recompute, ...)."""
        from .hf import weights_from_hf

        spec = weights_from_hf(module).spec
        moe = cls.__new__(cls)
        nn.Module.__init__(moe)
        moe._setup(spec, module.gate, module.experts, getattr(module, "shared_experts", None),
                   RegionOptions(**options))
        return moe

    def session(self) -> Session | None:
        """The runtime session of a distributed layer, opened at first use (collective
        over the ep_group); None in one process."""
        if not self.options.distributed:
            return None
        if self._session is None:
            from ..runtime import Session

            self._session = Session(self.options.runtime, self.options.ep_group)
            self._owns_session = True
        return self._session

    def close(self) -> None:
        """Close the runtime session this layer opened (a shared session stays open)."""
        if self._owns_session and self._session is not None:
            self._session.close()
            self._session = None
        self._owns_session = False

    def expert_weights(self) -> ExpertWeights:
        """The current parameters as ``ExpertWeights``, connected to autograd: router
        [E, H] float32, w13 [E, 2F, H], w2 [E, H, F], shared_w13 = cat(gate, up) [2Fs, H]."""
        bias = getattr(self.gate, "e_score_correction_bias", None)
        bias = torch.zeros(self.spec.experts) if bias is None else bias.float()
        sh = self.shared_experts if self.spec.shared_experts else None
        return ExpertWeights(
            spec=self.spec, router=self.gate.weight.float(), router_bias=bias,
            w13=self.experts.gate_up_proj, w2=self.experts.down_proj,
            shared_w13=None if sh is None else torch.cat([sh.gate_proj.weight, sh.up_proj.weight]),
            shared_w2=None if sh is None else sh.down_proj.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.shape[-1] != self.spec.hidden:
            raise ValueError(f"hidden_states must be [..., {self.spec.hidden}], got "
                             f"{tuple(getattr(hidden_states, 'shape', ()))}")
        x = hidden_states.reshape(-1, self.spec.hidden)
        w = self.expert_weights()
        routing = route(x, w)
        call = RegionCall(spec=self.spec, ids=routing.ids, router=w.router.detach(),
                          router_bias=w.router_bias, options=self.options, session=self.session())
        out = MoEFunction.apply(x, routing.weights, w.w13, w.w2, w.shared_w13, w.shared_w2, call)
        return out.view(hidden_states.shape)

    def extra_repr(self) -> str:
        o = self.options
        where = f"ep_group, schedule={o.policy.value}" if o.distributed else f"virtual_ep={o.virtual_ep}"
        return f"spec={self.spec}, {where}, recompute={o.recompute}"


# ---------------------------------------------------------------------------- autograd


@dataclass(frozen=True)
class RegionCall:
    """Non-tensor inputs of one region call: ids [N, k] int64 top-k expert ids of the
    local tokens; router [E, H] / router_bias [E] float32 (detached, routing only);
    session: the runtime session of a distributed layer, else None."""

    spec: MoESpec
    ids: torch.Tensor
    router: torch.Tensor
    router_bias: torch.Tensor
    options: RegionOptions
    session: Session | None = None


@dataclass
class RegionState:
    """What the backward taskflow needs from the forward one: the plan, per (virtual or
    local) rank the saved activations, the detached weights, the local top-k weights
    [N_local, k] float32, the options and the session (distributed runs)."""

    plan: RoutingPlan
    saved: list[SavedActivations]
    weights: ExpertWeights
    topk_weights: torch.Tensor
    options: RegionOptions
    session: Session | None = None
    device: Any = None  # the triton backend's forward (its arena holds the saved activations)

    def saved_bytes(self) -> int:
        return sum(s.nbytes() for s in self.saved)


class MoEFunction(torch.autograd.Function):
    """The MoE region as one autograd node.  Inputs: x [N, H] spec.dtype, routing
    weights [N, k] float32, w13 [E, 2F, H], w2 [E, H, F], shared_w13 [2Fs, H] | None,
    shared_w2 [H, Fs] | None, a ``RegionCall``.  Output: [N, H] spec.dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None,
                call: RegionCall) -> torch.Tensor:
        # detached: the runtime's worker threads run with grad mode on (it is per thread)
        x, topk_weights, w13, w2, shared_w13, shared_w2 = (
            None if t is None else t.detach() for t in (x, topk_weights, w13, w2, shared_w13, shared_w2))
        weights = ExpertWeights(call.spec, call.router, call.router_bias, w13, w2, shared_w13, shared_w2)
        routing = Routing(ids=call.ids, weights=topk_weights)
        run = _dist_forward if call.options.distributed else _virtual_forward
        out, ctx.state = run(x, weights, routing, call)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        state: RegionState = ctx.state
        ctx.state = None  # free the saved activations as soon as possible
        dy = dout.to(state.weights.spec.dtype).contiguous()
        run = _dist_backward if state.options.distributed else _virtual_backward
        g = run(state, dy)
        return g.dx, g.dweights, g.dw13, g.dw2, g.dshared_w13, g.dshared_w2, None


def _virtual_forward(x: torch.Tensor, weights: ExpertWeights, routing: Routing,
                     call: RegionCall) -> tuple[torch.Tensor, RegionState]:
    opt = call.options
    if opt.backend is Backend.TRITON:
        from ..gpu.backend import TritonOptions, triton_forward
        options = TritonOptions(policy=opt.policy, hardware=opt.hardware)
        fwd = triton_forward(x, weights, routing, opt.virtual_ep, opt.tiles, options)
        return fwd.out, RegionState(fwd.plan, [], weights, routing.weights, opt, device=fwd)
    fwd = execute_forward(x, weights, routing, opt.virtual_ep, opt.tiles, opt.schedule)
    saved = [SavedActivations.from_forward(b, opt.recompute) for b in fwd.buffers]
    return fwd.out, RegionState(fwd.plan, saved, weights, routing.weights, opt)


def _virtual_backward(state: RegionState, dy: torch.Tensor) -> Gradients:
    opt = state.options
    if state.device is not None:
        from ..gpu.backend import triton_backward
        return triton_backward(state.device, dy, opt.recompute)
    return execute_backward(state.saved, state.plan, dy, state.weights, state.topk_weights,
                            opt.tiles, opt.recompute, opt.schedule).grads


# ---------------------------------------------------------------------------- distributed




def _dist_forward(x: torch.Tensor, weights: ExpertWeights, routing: Routing,
                  call: RegionCall) -> tuple[torch.Tensor, RegionState]:
    """This rank's part of the forward region on the runtime: x [T, H] -> out [T, H]."""
    from ..runtime import ForwardOptions, ForwardRunner

    s, opt = call.session, call.options
    options = ForwardOptions(tiles=opt.tiles, policy=opt.policy, hardware=opt.rank_hardware)
    fwd = ForwardRunner(s, weights, options)(x, routing)
    b, drop = fwd.buffers, opt.recompute
    # recv and comb view the session's symmetric memory, which its next region reuses
    saved = SavedActivations(x=x, xe=b.recv.clone(), h=b.h, a=None if drop else b.a, comb=b.comb.clone(),
                             sh=b.sh, sa=None if drop else b.sa)
    return fwd.out, RegionState(fwd.plan, [saved], weights, routing.weights, opt, s)


def _backward_program(s: Session, plan: RoutingPlan, opt: RegionOptions, weights: ExpertWeights
                      ) -> tuple[RankProgram, Schedule, Region]:
    """Open a backward region on ``s``: snapshot the counters, then the region's
    agreement (a collective: no peer puts before every rank has snapshotted; in
    forward the count exchange does this); lower every rank, schedule, keep this
    rank's program."""
    s.transport.begin()
    region = BACKWARD_RECOMPUTE if opt.recompute else BACKWARD
    s.agree(region.kind, weights, plan.par.tokens_per_rank, opt.tiles)
    schedule = compile_region(plan, region, opt.tiles, opt.policy, opt.rank_hardware)
    return compile_program(schedule, region, s.rank), schedule, region


def _dist_backward(state: RegionState, dy: torch.Tensor) -> Gradients:
    """This rank's part of the backward region; expert gradients are full-size [E, ...]
    with this rank's experts filled in and zeros elsewhere."""
    s, opt, plan, w = state.session, state.options, state.plan, state.weights
    from ..runtime import Step

    program, schedule, region = _backward_program(s, plan, opt, w)
    sym = s.transport.prepare(Step(region, plan, opt.tiles, schedule, program))
    mine = slice(s.rank * plan.local_experts, (s.rank + 1) * plan.local_experts)
    dw13, dw2 = torch.zeros_like(w.w13), torch.zeros_like(w.w2)
    views = {"grecv": sym["grecv"], "gcomb": sym["gcomb"], "dw13": dw13[mine], "dw2": dw2[mine]}
    buf = BackwardBuffers.allocate(state.saved[0], dy, plan, views)
    ctx = BackwardContext.build(w, plan, state.topk_weights, s.rank)
    s.executor.run(program, region, buf, ctx, s.transport)
    shared = w.has_shared
    return Gradients(dx=buf.dx, dweights=buf.dw, dw13=dw13, dw2=dw2,
                     dshared_w13=buf.dsw13 if shared else None, dshared_w2=buf.dsw2 if shared else None)

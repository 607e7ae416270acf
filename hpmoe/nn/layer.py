"""``hpmoe.MoE``: an ``nn.Module`` whose MoE-FFN region runs as tile taskflows.

Routing runs in ordinary autograd — hpmoe's own gate (``MoE(spec)``) or, for a layer
built over a transformers block (``MoE.from_hf``, ``replace_moe_blocks``), the block's own
router module called as the block calls it, so output-capturing hooks, router logits and
auxiliary losses are those of transformers.  The region — dispatch, expert GEMMs and the
gated activation (``spec.activation``), combine, fusable shared experts — runs through
``MoEFunction``: the forward taskflow keeps minimal activations (``SavedActivations``,
handed to ``ctx.save_for_backward`` so saved-tensor hooks such as non-reentrant
checkpointing manage them), the backward taskflow returns the gradients of the input, of
the routing weights (autograd carries them on to the router), of the expert weights and
of the shared-expert weights.  Any token count works (0 included): the layer pads every
(virtual) rank to the same count with zero tokens of routing weight 0.

Dtypes: the region runs in the expert weights' dtype at call time (fp32, bf16, fp16; every
sum in fp32), or in the autocast dtype inside ``torch.autocast``; the output has the
input's dtype.  Parameters carry transformers' names, so state dicts are unchanged.

Execution:
  * single process: ``virtual_ep`` ranks (default 1) through the exact executors;
  * ``ep_group``: one EP rank per process of a torch.distributed group (any subgroup),
    on the multi-rank runtime (``hpmoe.runtime``: worker threads walking the queues of a
    ``SchedulePolicy``, one-sided puts over shared memory or torch.distributed; the
    forward region is the runtime's ``ForwardRunner``, the backward one ``run_backward``).
    Each rank holds its own tokens; expert ``e`` runs on rank ``e // (E / ep)``.  Every
    rank keeps full-size parameter tensors (state dicts stay those of transformers);
    expert gradients are complete on the owning rank and zero elsewhere, gradients of
    replicated parameters (router, shared experts) are this rank's share — all-reduce
    every gradient over the group (or wrap the model in DDP) as for data parallelism.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..engine import one_process_decision
from ..exec.arena import ArenaPool
from ..exec.backend import Backend, as_backend
from ..exec.exact import DEFAULT_TILES, execute_forward
from ..exec.exact_backward import Gradients, execute_backward
from ..exec.kernel_by_kernel import KernelByKernelCall, KernelByKernelFunction
from ..ir.schedule import SchedulePolicy, WorkerCounts
from ..placement import Placement, plan_placement, rank_loads
from ..regions.backward_kernels import SavedActivations
from ..regions.base import RegionKind
from ..regions.dedup_backward_kernels import DedupSaved
from ..regions.family import RegionFamily, region_family
from ..routing import Routing, RoutingPlan, input_error, route
from ..schedule.auto import AutoDecision, DecisionCache, Path, RoutingShape, saved_profile
from ..schedule.tune import Knobs, Space, TuneKey, TuneResult
from ..schedule.tuner import Trial, Tuner, timed
from ..sim.hardware import HardwareModel
from ..sim.presets import cpu_nominal
from ..spec import GateKind, MoESpec, ParallelSpec, TileSpec, require_per_expert
from ..weights import ExpertWeights
from .compiled import run_region
from .experts_impl import register, runs_region, select
from .families import FAMILIES, computing_experts, family_of, read_block
from .families.base import ExpertsLayout, ExpertTensors, Family, ScoreSide, expert_tensors, experts_dtype

if TYPE_CHECKING:  # the runtime is imported on first distributed use, never by ``import hpmoe``
    from ..runtime import ForwardOptions, RuntimeConfig, Session

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
    """``experts``: gate_up_proj [E, 2F, H] (gate rows [0, F), up rows [F, 2F), or
    alternating under ``MoESpec.glu.interleaved``) and down_proj [E, H, F], as transformers
    stores them; with biases also gate_up_proj_bias [E, 2F] and down_proj_bias [E, H]
    (``has_bias``, transformers' flag)."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, b13: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None):
        super().__init__()
        self.gate_up_proj = _param(gate_up_proj)
        self.down_proj = _param(down_proj)
        self.has_bias = b13 is not None
        if self.has_bias:
            self.gate_up_proj_bias, self.down_proj_bias = _param(b13), _param(b2)


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
    schedule: ``SchedulePolicy.AUTO`` (default).  With an ep_group and no ``hardware``,
      AUTO measures (``schedule.tune``): per key (machine, layer, EP group and network,
      dtype, tokens per rank to a power of two, with or without backward) the first calls
      try the candidates — the kernel-by-kernel path (``exec.kernel_by_kernel``: grouped
      GEMMs per phase, all-to-all over the ep_group) and the taskflow under each schedule
      policy, worker split, tile rows and dispatch mode (tiles only when left at their
      default) — every call a real step; the slowest rank's times decide, every rank runs
      the same winner from then on, and the choice is saved in the tuning cache
      (``hpmoe tune --show``) for later processes; see ``MoE.tuned``.  Candidates differ
      in rounding only by path and dispatch mode, so bits can differ between runs until
      the choice is cached: pin ``schedule`` for bitwise-reproducible runs.  With
      ``hardware`` (or in one process), whichever of the taskflow and the kernel-by-kernel
      path is forecast faster on ``hardware`` (else the calibrated profile of
      ``hpmoe calibrate``; in one process with neither, the kernel-by-kernel path); see
      ``MoE.decision``.  Otherwise the taskflow: with an ep_group, the runtime's
      ``SchedulePolicy`` (None: HYPERPARALLEL); in one process, the exact executors' task
      order: None (task-id order) or an int seeding a random valid order — every order
      gives the same bits.  Under ``torch.compile`` (one process) AUTO decides on the saved
      profile alone (``nn.compiled``).
    recompute: recompute the gated activations in backward instead of saving them.
    tiles: the tiling of the taskflow, its ``dispatch`` included: ``DispatchMode.PER_RANK``
      and ``PER_NODE`` run the deduplicated forward and backward regions (exact executors
      in one process, the runtime with an ep_group; gradients equal the per-expert ones but
      for dx, summed per rank first as ``refs.rank_partials_sum`` does).  The tiles describe
      the taskflow only: AUTO still picks the path (forecasting the deduplicated taskflow,
      on one node) and the kernel-by-kernel path ignores them.
    nodes: nodes the EP ranks span (``virtual_ep`` or the ep_group's size a multiple of
      it); only ``DispatchMode.PER_NODE`` relays between them.
    runtime: ``RuntimeConfig`` of the session the layer opens.
    hardware: the cost model of AUTO and of the CRITICAL_PATH scheduler.
    rebalance_every: every that many training calls (grad mode on), ``MoE.rebalance``
      with ``redundant`` extra replicas (0: never; a collective over the ep_group).
    backend: in one process, ``"exact"`` (torch kernels) or ``"triton"`` (each region one
      persistent Triton kernel on the input's device; ``schedule`` is then a
      ``SchedulePolicy``, AUTO and None meaning HYPERPARALLEL).
    """

    ep_group: Any = None
    virtual_ep: int = 1
    schedule: SchedulePolicy | int | None = SchedulePolicy.AUTO
    recompute: bool = False
    tiles: TileSpec = DEFAULT_TILES
    runtime: RuntimeConfig | None = None
    hardware: HardwareModel | None = None
    backend: Backend | str = Backend.EXACT
    nodes: int = 1
    rebalance_every: int = 0
    redundant: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", as_backend(self.backend))
        for name in ("rebalance_every", "redundant"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.virtual_ep, int) or isinstance(self.virtual_ep, bool) or self.virtual_ep <= 0:
            raise ValueError(f"virtual_ep must be a positive int, got {self.virtual_ep!r}")
        if not isinstance(self.recompute, bool):
            raise TypeError(f"recompute must be a bool, got {self.recompute!r}")
        if not isinstance(self.tiles, TileSpec):
            raise TypeError(f"tiles must be a TileSpec, got {type(self.tiles).__name__}")
        if not isinstance(self.nodes, int) or isinstance(self.nodes, bool) or self.nodes <= 0:
            raise ValueError(f"nodes must be a positive int, got {self.nodes!r}")
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
            require_per_expert(self.tiles, "the triton backend")
            if self.schedule is not None and not isinstance(self.schedule, SchedulePolicy):
                raise ValueError(f"schedule={self.schedule!r}: the triton backend takes a SchedulePolicy")
            if self.runtime is not None:
                raise ValueError("runtime configures the multi-rank runtime, not the triton backend")
            return
        seed = isinstance(self.schedule, int) and not isinstance(self.schedule, bool)
        auto = self.schedule is SchedulePolicy.AUTO
        if self.schedule is not None and not seed and not auto:
            raise ValueError(f"schedule={self.schedule!r}: in one process, schedule is AUTO, None or an "
                             "int seed (other scheduling policies need an ep_group)")
        if self.runtime is not None:
            raise ValueError("runtime configures the multi-rank runtime: it needs an ep_group")
        if self.hardware is not None and not auto:
            raise ValueError(f"hardware is AUTO's cost model in one process: schedule={self.schedule!r} "
                             "runs the taskflow without one")

    @property
    def distributed(self) -> bool:
        return self.ep_group is not None

    @property
    def regions(self) -> RegionFamily:
        """The region family the taskflow runs (per expert, or deduplicated)."""
        return region_family(self.tiles)

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
    def ranks(self) -> int:
        """EP ranks: the ep_group's size, else ``virtual_ep``."""
        return dist.get_world_size(self.group) if self.distributed else self.virtual_ep

    @property
    def group(self) -> Any:
        """The torch.distributed group of the EP ranks (None in one process)."""
        session = self.session
        return session.group if session is not None else self.ep_group

    @property
    def policy(self) -> SchedulePolicy:
        """The runtime's scheduling policy (distributed runs; AUTO's taskflow and None
        mean HYPERPARALLEL)."""
        fixed = isinstance(self.schedule, SchedulePolicy) and self.schedule is not SchedulePolicy.AUTO
        return self.schedule if fixed else SchedulePolicy.HYPERPARALLEL


# ---------------------------------------------------------------------------- module

_UNREAD = object()  # a layer's saved profile before it is read
LOAD_DECAY = 0.9  # of the measured per-expert load, per call
MIN_REBALANCE_GAIN = 1.05  # a new placement must lower the busiest rank's predicted load this much


class MoE(nn.Module):
    """A routed + shared MoE-FFN layer whose region runs as tile taskflows.

    Built from a spec (``MoE(spec, weights)``: hpmoe's own router, ``hpmoe.routing.route``)
    or over a transformers block (``MoE.from_hf(block)``: the block's own router module,
    called as the block calls it).
    spec: the layer shape; ``spec.dtype`` is the dtype the parameters were created in;
    the region runs in the dtype of the expert weights at call time (after ``.to()``,
    FSDP mixed precision), or in the autocast dtype inside ``torch.autocast``.
    weights: initial parameters (copied), or None for ``ExpertWeights.random(spec, seed)``.
    The other arguments are the fields of ``RegionOptions``.
    forward: hidden_states [..., H] -> [..., H] in the dtype of hidden_states; with an
    ep_group, this rank's tokens, any number of them (0 included) on every rank.
    """

    def __init__(self, spec: MoESpec, weights: ExpertWeights | None = None, *, ep_group: Any = None,
                 schedule: SchedulePolicy | int | None = SchedulePolicy.AUTO, recompute: bool = False,
                 virtual_ep: int = 1, tiles: TileSpec = DEFAULT_TILES, runtime: RuntimeConfig | None = None,
                 hardware: HardwareModel | None = None, seed: int = 0, backend: Backend | str = "exact",
                 nodes: int = 1, rebalance_every: int = 0, redundant: int = 0):
        super().__init__()
        if not isinstance(spec, MoESpec):
            raise TypeError(f"spec must be a MoESpec, got {type(spec).__name__}")
        w = ExpertWeights.random(spec, seed) if weights is None else weights
        if not isinstance(w, ExpertWeights) or w.spec != spec:
            raise ValueError(f"weights must be ExpertWeights of spec {spec}, got {getattr(w, 'spec', w)!r}")
        fs = spec.shared_ffn
        bias = w.router_bias.detach().clone() if spec.gate is GateKind.SIGMOID else None
        parts = (w.shared_w13[:fs], w.shared_w13[fs:], w.shared_w2) if fs else ()
        self.experts = FusedExperts(*(t.detach().clone() for t in (w.w13, w.w2, *w.biases)))
        self.gate = TopkRouter(w.router.detach().clone(), bias)
        self.shared_experts = SharedMLP(*(t.detach().clone() for t in parts)) if fs else None
        self._setup(spec, None, "shared_experts" if fs else None,
                    RegionOptions(ep_group, virtual_ep, schedule, recompute, tiles, runtime, hardware,
                                  backend, nodes, rebalance_every, redundant))

    def _setup(self, spec: MoESpec, family: Family | None, fused_shared: str | None,
               options: RegionOptions) -> None:
        # raises, naming them
        ParallelSpec(ep=options.ranks, tokens_per_rank=1, nodes=options.nodes).local_experts(spec)
        self.spec = spec
        self.family = family
        self.fused_shared = fused_shared
        self.options = options
        self._session = options.session
        self._owns_session = False
        self._decisions = DecisionCache()
        self._tuner = Tuner()
        self._placement: Placement | None = None
        self._load = torch.zeros(spec.experts, dtype=torch.float64, device="cpu")  # moves to the routing's
        self._calls = 0
        self._profile: Any = _UNREAD
        self._arenas = ArenaPool()
        self._computing: int | None = None  # computing experts when some are identity ones

    @classmethod
    def from_hf(cls, module: nn.Module, **options: Any) -> MoE:
        """An hpmoe layer over the very submodules of a transformers MoE block of a family in
        ``hpmoe.nn.families.FAMILIES``: parameter objects, names and buffers are unchanged and
        the block's router module routes.  Raises ``TypeError`` for a block of no known family
        and ``ValueError`` naming the family and the feature for one whose maths the region
        does not compute.  ``options``: fields of ``RegionOptions``."""
        family = family_of(module)
        if family is None:
            names = sorted(f.block for f in FAMILIES)
            raise TypeError(f"module must be a transformers MoE block of {names}, "
                            f"got {type(module).__name__}")
        checked = RegionOptions(**options)
        layout = read_block(module, family, checked.virtual_ep)
        register()
        select(getattr(module, "experts", None))
        moe = cls.__new__(cls)
        nn.Module.__init__(moe)
        for name, p in module.named_parameters(recurse=False):  # a shared output bias (JetMoE)
            moe.register_parameter(name, p)
        for name, child in module.named_children():
            moe.add_module(name, child)
        for attr in (family.jitter, *family.block_attrs):
            if attr:
                setattr(moe, attr, getattr(module, attr))
        for name, buf in module.named_buffers(recurse=False):  # the very tensors, under their names
            moe.register_buffer(name, buf, persistent=name not in module._non_persistent_buffers_set)
        moe._setup(layout.spec, family, layout.fused_shared, checked)
        moe._computing = computing_experts(module, family)
        object.__setattr__(moe, "_hf_block", module)  # not a submodule: only ``as_block`` reads it
        return moe

    def as_block(self) -> nn.Module | None:
        """The transformers block this layer replaced, holding this layer's current direct
        parameters and buffers (the same tensors), or None for a layer built from a spec.
        transformers' ``_init_weights`` initialises a block's own tensors only when the
        module *is* the block class (JetMoE's output bias, MiniMax-M2's score-correction
        bias): ``replace_moe_blocks`` hands it this instead of the layer."""
        block = getattr(self, "_hf_block", None)
        if block is not None:
            block._parameters.update(self._parameters)
            block._buffers.update(self._buffers)
        return block

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

    @property
    def _layout(self) -> ExpertsLayout:
        return self.family.layout if self.family else ExpertsLayout.FUSED

    def _expert_tensors(self) -> ExpertTensors:
        return expert_tensors(self, self._layout, self._computing)

    def expert_weights(self) -> ExpertWeights:
        """The current parameters as ``ExpertWeights`` in their current dtype, connected to
        autograd: router [E, H] float32 (hpmoe's own router; zeros for a transformers block,
        whose router module routes), w13 [E, 2F, H], w2 [E, H, F] (views of the block's
        expert parameters, or a copy where its layout needs one), shared_w13 = cat(gate, up)."""
        t = self._expert_tensors()
        w13 = t.w13
        spec = replace(self.spec, dtype=w13.dtype)
        router = torch.zeros((), dtype=torch.float32, device=w13.device).expand(spec.experts, spec.hidden)
        bias = torch.zeros(spec.experts, dtype=torch.float32, device=w13.device)
        if self.family is None:
            router = self.gate.weight.float()
            b = getattr(self.gate, "e_score_correction_bias", None)
            bias = bias if b is None else b.float()
        sh = getattr(self, self.fused_shared) if self.fused_shared else None
        return ExpertWeights(
            spec=spec, router=router, router_bias=bias, w13=w13, w2=t.w2,
            shared_w13=None if sh is None else torch.cat([sh.gate_proj.weight, sh.up_proj.weight]),
            shared_w2=None if sh is None else sh.down_proj.weight, b13=t.b13, b2=t.b2)

    def forward(self, hidden_states: torch.Tensor, *args: Any,
                **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """[..., H] -> [..., H]; a block that also returns a router output (``Family.returns``)
        returns ``(hidden, that output)`` as the block does.  A layer over a transformers
        block also takes hidden states flattened to [N * H] (Ernie-4.5-VL's modality
        sub-blocks are called so) and, where its family routes with ``Family.route``, the
        block's other forward arguments."""
        h = self.spec.hidden
        is_tensor = isinstance(hidden_states, torch.Tensor)
        flat = is_tensor and hidden_states.dim() == 1 and not hidden_states.numel() % h
        if not is_tensor or (hidden_states.shape[-1] != h and not (flat and self.family is not None)):
            raise ValueError(f"hidden_states must be [..., {h}], got "
                             f"{tuple(getattr(hidden_states, 'shape', ()))}")
        if (args or kwargs) and (self.family is None or self.family.route is None):
            raise TypeError(f"{type(self).__name__}.forward takes hidden_states only, got "
                            f"{len(args)} more positional and {sorted(kwargs)} keyword arguments")
        x = hidden_states.reshape(-1, h)
        if self.family is None:
            w = self.expert_weights()
            try:
                routing = route(x.to(w.spec.dtype), w)
            except (ValueError, TypeError) as err:  # every rank must hear of it, in step
                if self.options.distributed:
                    self._open_call(x.shape[0], w, err)
                raise
            return self._region(x, routing.ids, routing.weights).view(hidden_states.shape)
        out, router_out = self._block_forward(x, hidden_states, args, kwargs)
        out = out.view(hidden_states.shape)
        return out if self.family.returns is None else (out, router_out[self.family.returns])

    def _block_forward(self, x: torch.Tensor, hidden_states: torch.Tensor, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        """What the transformers block computes, with its routed experts (and a fusable
        shared MLP) run by the region: jitter, router (``Family.route`` with the block's
        input ``hidden_states`` and other arguments, else ``router(x, *router_args)``),
        region, then a shared expert that runs beside the region, a shared output bias and
        ``Family.post``; returns (hidden, router output).  While the experts' config names a
        transformers experts implementation instead of "hpmoe", the experts module runs
        (``experts_impl``)."""
        fam = self.family
        amp = getattr(self, fam.jitter) if fam.jitter else 0.0
        if self.training and amp > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - amp, 1.0 + amp)
        if fam.route is not None:
            routed = fam.route(self, x, hidden_states, *args, **kwargs)
        else:
            routed = getattr(self, fam.router)(x, *(getattr(self, a) for a in fam.router_args))
        weights, ids = fam.topk(self, routed) if fam.topk else (routed[1], routed[2])
        experts = getattr(self, "experts", None)
        region = runs_region(experts)  # config._experts_implementation == "hpmoe"
        out = self._routed(x, ids, weights) if region else experts(x, ids, weights)
        beside = fam.shared and not (region and self.fused_shared)
        shared = getattr(self, fam.shared, None) if beside else None  # None: a block built without one
        if shared is not None:
            s = shared(x)
            if fam.shared_gate:
                s = torch.sigmoid(getattr(self, fam.shared_gate)(x)) * s
            out = out + s
        if fam.output_bias:
            out = out + getattr(self, fam.output_bias)
        if fam.post is not None:
            out = fam.post(self, x, out, routed)
        return out, routed

    def _routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts of a block: zero-computation (identity) slots add the token
        itself times its weight, and run in the region as rows of weight 0 of a computing
        expert (exact; each costs a row); scores on the expert input run one region call
        per slot (``x * score`` routed with weight 1)."""
        identity = None
        if self._computing is not None:
            e = self._computing
            zero = ids >= e
            terms = x.unsqueeze(1).float() * (weights * zero).unsqueeze(-1).float()  # [N, k, H]
            identity = terms.sum(1).to(x.dtype)
            ids, weights = torch.where(zero, ids % e, ids), weights.masked_fill(zero, 0.0)
        if self.family.score_side is ScoreSide.INPUT:
            ones = torch.ones_like(ids[:, :1], dtype=torch.float32)
            out = sum(self._region(x * weights[:, j:j + 1].to(x.dtype), ids[:, j:j + 1], ones)
                      for j in range(ids.shape[1]))
        else:
            out = self._region(x, ids, weights)
        return out if identity is None else out + identity

    def _region(self, x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Run the region on x [N, H] routed by ids [N, k] with weights [N, k] (any float
        dtype; combined in fp32).  Computes in the experts' dtype, or the autocast dtype;
        pads the batch to equal token counts per (virtual) rank with zero rows of weight 0."""
        w = self.expert_weights()
        dtype = _compute_dtype(x, w.spec.dtype)
        if dtype != w.spec.dtype:
            w = _cast(w, dtype)
        o, xc, ids, topk_weights = self.options, x.to(dtype), ids.to(torch.int64), topk_weights.float()
        n, tokens = x.shape[0], torch.arange(x.shape[0], device=ids.device)
        if o.distributed:
            counts = self._open_call(n, w, input_error(xc, Routing(ids, topk_weights), w.spec))
            padded, rank = max(max(counts), 1), self.session().rank
            token_rank, first = torch.full_like(tokens, rank), sum(counts[:rank])
        else:
            padded = max(-(-n // o.virtual_ep), 1) * o.virtual_ep
            token_rank, first = tokens // (padded // o.virtual_ep), 0
        self._measure_load(ids)
        if self._placement is not None:  # the physical layer: one expert per slot
            ids = self._placement.physical_ids(ids, token_rank, first + tokens)
            w = self._placement.physical_weights(w)
        xp, idp, wp = _pad(xc, ids, topk_weights, padded, w.spec, o.virtual_ep, o.group)
        with torch.autocast(x.device.type, enabled=False):
            out = self._run(xp, idp, wp, w)
        return out[:x.shape[0]].to(x.dtype)

    def _open_call(self, tokens: int, w: ExpertWeights, error: BaseException | None) -> list[int]:
        """The agreement that opens every distributed call, before any other collective
        of it: what the call is (dtype, sizes, tiles, the tuning history) and each rank's
        verdict on its own input; it also carries each rank's time of the previous call
        (the tuner's trial).  Every rank raises the same named error when one objects;
        else returns every rank's token count."""
        trial, micros = self._tuner.report()
        layout = self._placement.digest() if self._placement is not None else 0
        table = self.session().open_call(RegionKind.FORWARD, w, self.options.tiles, tokens, error,
                                         (trial, micros), self._tuner.digest(), layout)
        self._tuner.observe(table[:, 1].tolist(), table[:, 2].tolist(), self.session().rank)
        return table[:, 0].tolist()

    def _run(self, x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor,
             w: ExpertWeights) -> torch.Tensor:
        """The region on padded inputs, on the path AUTO chose (or is trying) or the
        options fix; a tuning trial is timed here and in the backward."""
        o = self.options
        tensors = (x, topk_weights, w.w13, w.w2, w.shared_w13, w.shared_w2, w.b13, w.b2)
        if torch.compiler.is_compiling() and not o.distributed and o.backend is Backend.EXACT:
            auto = o.schedule is SchedulePolicy.AUTO
            return run_region(x, ids, topk_weights, w, o.virtual_ep, o.tiles, auto, o.nodes)
        options, trial = self._choose(x.shape[0], w.spec.dtype)
        with timed(trial):
            if options is None:
                grad = torch.is_grad_enabled()
                call = KernelByKernelCall(w.spec, ids, self.session() if o.distributed else None, o.tiles,
                                          self._arenas, o.recompute, grad, trial)
                return KernelByKernelFunction.apply(*tensors, call)
            call = RegionCall(spec=w.spec, ids=ids, options=options, session=self.session(), trial=trial)
            return MoEFunction.apply(*tensors, call)

    # ------------------------------------------------------------------ placement

    @property
    def placement(self) -> Placement | None:
        """Which physical slot holds which expert (``hpmoe.placement``); None: expert ``e``
        on rank ``e // (E / ep)``.  Set it (the same on every rank) or let ``rebalance``
        plan it; every rank keeps full-size parameters and optimizer state, so a new
        placement moves nothing."""
        return self._placement

    @placement.setter
    def placement(self, placement: Placement | None) -> None:
        o, ranks = self.options, self.options.ranks
        if placement is not None:
            if not isinstance(placement, Placement):
                raise TypeError(f"placement must be a Placement, got {type(placement).__name__}")
            if (placement.experts, placement.ranks, placement.nodes) != (self.spec.experts, ranks, o.nodes):
                raise ValueError(f"placement is for {placement.experts} experts on {placement.ranks} ranks, "
                                 f"{placement.nodes} nodes; the layer has {self.spec.experts} experts on "
                                 f"{ranks} ranks, {o.nodes} nodes")
            if placement.is_identity:
                placement = None
        self._placement = placement

    def expert_load(self) -> np.ndarray:
        """[E] this rank's measured routed rows per expert: an exponential moving average
        over calls (``LOAD_DECAY`` per call)."""
        return self._load.cpu().numpy().copy()

    def rebalance(self, redundant: int = 0, min_gain: float = MIN_REBALANCE_GAIN) -> Placement | None:
        """Plan a placement from the measured load of every rank (collective over the
        ep_group): ``redundant`` extra replicas of the most loaded experts, packed onto
        ranks (``plan_placement``).  Adopted only when it lowers the busiest rank's
        predicted load (``rank_loads``) by ``min_gain`` or more; returns the placement in
        effect."""
        load = self._load.cpu()
        if self.options.distributed:
            load = self.session().collectives.all_gather(load, "rebalance: expert load").sum(0)
        o = self.options
        plan = plan_placement(load.numpy(), o.ranks, redundant, o.nodes)
        now = self._placement or Placement.identity(self.spec.experts, o.ranks, o.nodes)
        if rank_loads(now, load.numpy()).max() >= min_gain * rank_loads(plan, load.numpy()).max():
            self.placement = plan
        return self._placement

    def _measure_load(self, ids: torch.Tensor) -> None:
        """The per-expert load's EMA and the periodic rebalance; not under torch.compile
        (a counter on the module would make every call recompile: measure in eager steps)."""
        if torch.compiler.is_compiling():
            return
        rows = torch.bincount(ids.detach().flatten(), minlength=self.spec.experts).double()
        self._load = LOAD_DECAY * self._load.to(rows.device) + (1.0 - LOAD_DECAY) * rows  # no host sync
        self._calls += 1
        every = self.options.rebalance_every
        if every and self._calls % every == 0 and torch.is_grad_enabled():
            self.rebalance(self.options.redundant)

    def _region_spec(self, dtype: torch.dtype | None) -> MoESpec:
        """The layer the region computes in ``dtype`` (default: the parameters'): one
        expert per physical slot under a placement."""
        spec = replace(self.spec, dtype=dtype or experts_dtype(self, self._layout))
        return self._placement.physical_spec(spec) if self._placement is not None else spec

    def decision(self, tokens: int, backward: bool | None = None,
                 dtype: torch.dtype | None = None) -> AutoDecision:
        """AUTO's decision for ``tokens`` tokens per call after padding (this rank's, with
        an ep_group; the whole batch in one process), with the backward when ``backward``
        (default: grad mode is on), computing in ``dtype`` (default: the parameters').
        Made at the first call of each shape (collective over the ep_group: group rank 0
        forecasts and broadcasts), then cached."""
        o = self.options
        spec = self._region_spec(dtype)
        backward = torch.is_grad_enabled() if backward is None else backward
        if not o.distributed:
            return one_process_decision(spec, o.virtual_ep, tokens, o.tiles, o.hardware, self._decisions,
                                        backward)
        shape = RoutingShape(spec, o.ranks, tokens, backward)
        workers = WorkerCounts.from_hardware(o.rank_hardware)
        return self._decisions.decide(shape, o.tiles, o.hardware, workers, self.session().collectives)

    def tuned(self, tokens: int, backward: bool | None = None,
              dtype: torch.dtype | None = None) -> TuneResult | None:
        """What AUTO's tuning settled on for ``tokens`` tokens per rank (after padding),
        with the backward when ``backward`` (default: grad mode is on), computing in
        ``dtype`` (default: the parameters'): the winner, its time, the runner-up, the
        kernel-by-kernel path's time and the tuning's cost; None while it is still tuning
        (or the layer does not tune: one process, a fixed schedule, an explicit
        ``hardware`` model)."""
        if not self.options.distributed:
            return None
        return self._tuner.result(self._tune_key(tokens, backward, dtype))

    def _tune_key(self, tokens: int, backward: bool | None, dtype: torch.dtype | None) -> TuneKey:
        o = self.options
        spec = self._region_spec(dtype)
        backward = torch.is_grad_enabled() if backward is None else backward
        network = self.session().config.tuning_network
        return self._tuner.key(spec, o.ranks, o.nodes, network, tokens, backward)

    def _choose(self, tokens: int, dtype: torch.dtype) -> tuple[RegionOptions | None, Trial | None]:
        """The taskflow's options for a call computing in ``dtype`` (None: the
        kernel-by-kernel path) and the tuning trial it is (None: not tuning).  AUTO with
        an ep_group and no explicit ``hardware`` measures (``schedule.tune``); otherwise
        the model decides (``decision``)."""
        o = self.options
        if o.schedule is not SchedulePolicy.AUTO or o.backend is Backend.TRITON:
            return o, None
        if o.distributed and o.hardware is None:
            space = Space.around(o.tiles, DEFAULT_TILES, o.nodes)
            key = self._tune_key(tokens, None, dtype)
            first = None if self._tuner.knows(key) else self._model_first(tokens, dtype, space)
            trial = self._tuner.start(key, space, self.session().collectives, first)
            return self._knob_options(trial.knobs), trial
        chosen = self.decision(tokens, dtype=dtype).chosen
        if chosen.path is not Path.TASKFLOW:
            return None, None
        if o.distributed:
            return replace(o, schedule=chosen.policy), None
        return replace(o, schedule=None, hardware=None), None  # task-id order; AUTO's model has served

    def _model_first(self, tokens: int, dtype: torch.dtype, space: Space) -> Knobs | None:
        """What the saved profile forecasts fastest (the tuner measures it first); None
        without one."""
        if self._rank_model() is None:
            return None
        return space.of(self.decision(tokens, dtype=dtype).chosen)

    def _rank_model(self) -> HardwareModel | None:
        """The saved cpu profile, read once per layer (None when there is none)."""
        if self._profile is _UNREAD:
            self._profile = saved_profile()
        return self._profile

    def _knob_options(self, knobs: Knobs) -> RegionOptions | None:
        """The options that run ``knobs`` (None: the kernel-by-kernel path); the worker
        threads are the rank model's (the saved profile's rates, else nominal ones)."""
        if knobs.path is not Path.TASKFLOW:
            return None
        base = self._rank_model() or cpu_nominal()
        w = knobs.workers
        hw = dataclasses.replace(base, matrix_workers=w.matrix, vector_workers=w.vector)
        return replace(self.options, schedule=knobs.policy, tiles=knobs.tiles, hardware=hw)

    def extra_repr(self) -> str:
        o = self.options
        where = f"ep_group, schedule={o.policy.value}" if o.distributed else f"virtual_ep={o.virtual_ep}"
        family = f"family={self.family.name}, " if self.family else ""
        return f"{family}spec={self.spec}, {where}, recompute={o.recompute}"


def _compute_dtype(x: torch.Tensor, weights_dtype: torch.dtype) -> torch.dtype:
    """The autocast dtype inside ``torch.autocast``, else the expert weights' dtype."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weights_dtype


def _cast(w: ExpertWeights, dtype: torch.dtype) -> ExpertWeights:
    """``w`` with its expert tensors cast to ``dtype`` (differentiably)."""
    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype)

    return ExpertWeights(replace(w.spec, dtype=dtype), w.router, w.router_bias, cast(w.w13), cast(w.w2),
                         cast(w.shared_w13), cast(w.shared_w2), cast(w.b13), cast(w.b2))


def _pad(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, total: int, spec: MoESpec,
         virtual_ep: int, group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append ``total - N`` zero tokens of routing weight 0, each routed to the first local
    expert of the rank that holds it: no communication, an expert output of exactly 0, and
    nothing added to any gradient."""
    n, k = ids.shape
    if total == n:
        return x, ids, weights
    ranks = virtual_ep if group is None else dist.get_world_size(group)
    local = max(spec.experts // ranks, 1)
    pos = torch.arange(n, total, device=ids.device)
    owner = pos // (total // ranks) if group is None else torch.full_like(pos, dist.get_rank(group))
    pad_ids = (owner * local).clamp(max=spec.experts - 1).unsqueeze(1).expand(total - n, k)
    return (torch.cat([x, x.new_zeros(total - n, x.shape[1])]), torch.cat([ids, pad_ids]),
            torch.cat([weights, weights.new_zeros(total - n, k)]))


# ---------------------------------------------------------------------------- autograd


@dataclass(frozen=True)
class RegionCall:
    """Non-tensor inputs of one region call: the spec (dtype: the compute dtype); ids
    [N, k] int64 top-k expert ids of the local tokens; session: the runtime session of a
    distributed layer, else None."""

    spec: MoESpec
    ids: torch.Tensor
    options: RegionOptions
    session: Session | None = None
    trial: Trial | None = None  # the tuner's trial of this call: the backward's seconds go into it


@dataclass
class RegionState:
    """What the backward taskflow needs from the forward one: the plan, per (virtual or
    local) rank the saved activations (``DedupSaved`` under deduplicated tiles), the
    detached weights, the routing the contexts are built from (ids and top-k weights
    [N, k] float32: this rank's, or every rank's under deduplicated tiles on the
    runtime, whose receivers weigh rows), the options and the session (distributed runs)."""

    plan: RoutingPlan
    saved: list[SavedActivations] | list[DedupSaved]
    weights: ExpertWeights | None
    routing: Routing | None
    options: RegionOptions
    session: Session | None = None
    device: Any = None  # the triton backend's forward (its arena holds the saved activations)
    nbytes: int = 0
    trial: Trial | None = None

    def saved_bytes(self) -> int:
        """Bytes of the saved activations (the input x excluded)."""
        return self.nbytes or sum(s.nbytes() for s in self.saved)

    def pack(self) -> tuple[list[torch.Tensor | None], RegionState]:
        """Every tensor of the state, for ``ctx.save_for_backward`` (so saved-tensor hooks,
        e.g. non-reentrant activation checkpointing, see and may free them), and the state
        without them."""
        w = self.weights
        tensors = [getattr(s, f.name) for s in self.saved for f in fields(s)]
        tensors += [w.router, w.router_bias, w.w13, w.w2, w.shared_w13, w.shared_w2, w.b13, w.b2,
                    self.routing.ids, self.routing.weights]
        bare = replace(self, saved=[None] * len(self.saved), weights=None, routing=None,
                       nbytes=self.saved_bytes())
        return tensors, bare

    def unpack(self, tensors: tuple[torch.Tensor | None, ...]) -> RegionState:
        """The inverse of ``pack``: this bare state with ``tensors`` put back."""
        kind = self.options.regions.saved_kind
        n, ranks = len(fields(kind)), len(self.saved)
        saved = [kind(*tensors[r * n:(r + 1) * n]) for r in range(ranks)]
        *weight_tensors, ids, topk = tensors[ranks * n:]
        weights = ExpertWeights(self.plan.moe, *weight_tensors)
        return replace(self, saved=saved, weights=weights, routing=Routing(ids, topk))


class MoEFunction(torch.autograd.Function):
    """The MoE region as one autograd node.  Inputs: x [N, H] spec.dtype, routing
    weights [N, k] float32, w13 [E, 2F, H], w2 [E, H, F], shared_w13 [2Fs, H] | None,
    shared_w2 [H, Fs] | None, b13 [E, 2F] | None, b2 [E, H] | None, a ``RegionCall``.
    Output: [N, H] spec.dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: torch.Tensor, *tensors: Any) -> torch.Tensor:
        *weight_tensors, call = tensors
        # detached: the runtime's worker threads run with grad mode on (it is per thread)
        x, topk_weights = x.detach(), topk_weights.detach()
        weights = ExpertWeights.routed(call.spec, *(t if t is None else t.detach() for t in weight_tensors))
        routing = Routing(ids=call.ids, weights=topk_weights)
        run = _dist_forward if call.options.distributed else _virtual_forward
        out, state = run(x, weights, routing, call)
        tensors, ctx.state = replace(state, trial=call.trial).pack()
        ctx.save_for_backward(*tensors)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        state: RegionState = ctx.state.unpack(ctx.saved_tensors)
        dy = dout.to(state.weights.spec.dtype).contiguous()
        run = _dist_backward if state.options.distributed else _virtual_backward
        with timed(state.trial):
            g = run(state, dy)
        return g.dx, g.dweights, *g.expert_tensors, None


def _virtual_forward(x: torch.Tensor, weights: ExpertWeights, routing: Routing,
                     call: RegionCall) -> tuple[torch.Tensor, RegionState]:
    opt = call.options
    if opt.backend is Backend.TRITON:
        from ..gpu.backend import TritonOptions, triton_forward
        options = TritonOptions(policy=opt.policy, hardware=opt.hardware)
        fwd = triton_forward(x, weights, routing, opt.virtual_ep, opt.tiles, options)
        return fwd.out, RegionState(fwd.plan, [], weights, routing, opt, device=fwd)
    fwd = execute_forward(x, weights, routing, opt.virtual_ep, opt.tiles, opt.schedule, opt.nodes)
    saved = [opt.regions.saved(b, opt.recompute) for b in fwd.buffers]
    return fwd.out, RegionState(fwd.plan, saved, weights, routing, opt)


def _virtual_backward(state: RegionState, dy: torch.Tensor) -> Gradients:
    opt = state.options
    if state.device is not None:
        from ..gpu.backend import triton_backward
        return triton_backward(state.device, dy, opt.recompute).grads
    return execute_backward(state.saved, state.plan, dy, state.weights, state.routing, opt.tiles,
                            opt.recompute, opt.schedule).grads


# ---------------------------------------------------------------------------- distributed


def _dist_forward(x: torch.Tensor, weights: ExpertWeights, routing: Routing,
                  call: RegionCall) -> tuple[torch.Tensor, RegionState]:
    """This rank's part of the forward region on the runtime: x [T, H] -> out [T, H]."""
    from ..runtime import ForwardRunner

    s, opt = call.session, call.options
    fwd = ForwardRunner(s, weights, _runtime_options(opt))(x, routing)
    saved = opt.regions.saved(fwd.buffers, opt.recompute, symmetric=True)
    return fwd.out, RegionState(fwd.plan, [saved], weights, fwd.routing, opt, s)


def _dist_backward(state: RegionState, dy: torch.Tensor) -> Gradients:
    """This rank's part of the backward region (``runtime.run_backward``); expert
    gradients are full-size [E, ...] with this rank's experts filled in and zeros elsewhere."""
    from ..runtime import run_backward

    opt = state.options
    return run_backward(state.session, state.plan, state.saved[0], dy, state.weights, state.routing,
                        _runtime_options(opt), opt.recompute).grads


def _runtime_options(opt: RegionOptions) -> ForwardOptions:
    from ..runtime import ForwardOptions

    return ForwardOptions(tiles=opt.tiles, policy=opt.policy, hardware=opt.rank_hardware, nodes=opt.nodes)

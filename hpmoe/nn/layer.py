"""``hpmoe.MoE``: an ``nn.Module`` whose MoE-FFN region runs as tile taskflows.

Routing runs in ordinary autograd — hpmoe's own gate (``MoE(spec)``) or, for a layer
built over a transformers block (``MoE.from_hf``, ``replace_moe_blocks``), the block's own
router module called as the block calls it, so output-capturing hooks, router logits and
auxiliary losses are those of transformers.  The region — dispatch, expert GEMMs and the
gated activation (``spec.activation``), combine, fusable shared experts — is handed to
the engine (``engine.door``: check, agree, place, select, run), which runs it as one
autograd node (``engine.RegionFunction``) on the path ``engine.select`` chooses, keeping
for the backward what ``recompute`` leaves.  Any token count works (0 included).

Dtypes: the region runs in the expert weights' dtype at call time (fp32, bf16, fp16; every
sum in fp32), or in the autocast dtype inside ``torch.autocast``; the output has the
input's dtype.  Parameters carry transformers' names (``nn.modules``), so state dicts are
unchanged.  With an ``ep_group`` each rank holds its own tokens; gradients of replicated
parameters (router, shared experts) are this rank's share: all-reduce them over the group
(or wrap the model in DDP) as for data parallelism.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ..engine import RegionOptions
from ..engine.balance import MIN_REBALANCE_GAIN, own_rows
from ..engine.check import CheckMode
from ..engine.checkpoint import attach, held
from ..engine.door import CallRecord, Door
from ..engine.selection import runtime_policy
from ..exec.backend import Backend
from ..exec.exact import DEFAULT_TILES
from ..ir.schedule import SchedulePolicy
from ..migration import Migration
from ..placement import Placement, starting_placement
from ..routing import route
from ..schedule.auto import AutoDecision
from ..schedule.tune import TuneResult
from ..sim.hardware import HardwareModel
from ..spec import GateKind, MoESpec, ParallelSpec, Recompute, TileSpec
from ..weights import ExpertWeights, router_placeholders
from .experts_impl import register, runs_region
from .experts_impl import select as select_experts
from .families import FAMILIES, computing_experts, family_of, read_block
from .families.base import ExpertsLayout, ExpertTensors, Family, ScoreSide, expert_tensors, experts_dtype
from .modules import FusedExperts, SharedMLP, TopkRouter
from .weights_cache import WeightsCache

if TYPE_CHECKING:  # the runtime is imported on first distributed use, never by ``import hpmoe``
    from ..runtime import RuntimeConfig, Session

# ---------------------------------------------------------------------------- module


def _initial(w: ExpertWeights, stored: slice | list[int]) -> tuple[
        tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """A spec-built layer's values from ``w`` (copies): the ``stored`` experts' rows of
    w13, w2 (and biases), the router, a sigmoid gate's score-correction bias (else None)
    and the shared expert's gate, up and down (none without one)."""
    s, fs = w.spec, w.spec.shared_ffn
    bias = w.router_bias.detach().clone() if s.gate is GateKind.SIGMOID else None
    shared = (w.shared_w13[:fs], w.shared_w13[fs:], w.shared_w2) if fs else ()
    return (tuple(t.detach()[stored].clone() for t in (w.w13, w.w2, *w.biases)), w.router.detach().clone(),
            bias, tuple(t.detach().clone() for t in shared))


class MoE(nn.Module):
    """A routed + shared MoE-FFN layer whose region runs as tile taskflows.

    Built from a spec (``MoE(spec, weights)``: hpmoe's own router, ``hpmoe.routing.route``)
    or over a transformers block (``MoE.from_hf(block)``: the block's own router module,
    called as the block calls it).
    spec: the layer shape; ``spec.dtype`` is the dtype the parameters were created in;
    the region runs in the dtype of the expert weights at call time (after ``.to()``,
    FSDP mixed precision), or in the autocast dtype inside ``torch.autocast``.
    weights: initial parameters (copied), or None for ``ExpertWeights.random(spec, seed)``.
    The other arguments are the fields of ``RegionOptions``.  Every call goes through the
    layer's front door (``engine.door.Door``): check, agree, place, select, run.
    forward: hidden_states [..., H] -> [..., H] in the dtype of hidden_states; with an
    ep_group, this rank's tokens, any number of them (0 included) on every rank.
    """

    def __init__(self, spec: MoESpec, weights: ExpertWeights | None = None, *, ep_group: Any = None,
                 schedule: SchedulePolicy | int | None = SchedulePolicy.AUTO,
                 recompute: Recompute | bool | str = Recompute.PERMUTATION,
                 virtual_ep: int = 1, tiles: TileSpec = DEFAULT_TILES, runtime: RuntimeConfig | None = None,
                 hardware: HardwareModel | None = None, seed: int = 0, backend: Backend | str = "exact",
                 nodes: int = 1, rebalance_every: int = 0, redundant: int = 0, shard_experts: bool = False,
                 check: CheckMode | str = CheckMode.DEFERRED, offload: bool = False):
        super().__init__()
        if not isinstance(spec, MoESpec):
            raise TypeError(f"spec must be a MoESpec, got {type(spec).__name__}")
        w = ExpertWeights.random(spec, seed, torch.get_default_device()) if weights is None else weights
        if not isinstance(w, ExpertWeights) or w.spec != spec:
            raise ValueError(f"weights must be ExpertWeights of spec {spec}, got {getattr(w, 'spec', w)!r}")
        options = RegionOptions(ep_group, virtual_ep, schedule, recompute, tiles, runtime, hardware, backend,
                                nodes, rebalance_every, redundant, shard_experts, check, offload)
        first, stored = None, slice(None)
        if shard_experts:
            first = starting_placement(spec.experts, options.ranks, options.redundant, options.nodes)
            stored = list(first.phy2log[own_rows(spec, options, first)])
        experts, router, bias, shared = _initial(w, stored)
        self.experts = FusedExperts(*experts)
        self.gate = TopkRouter(router, bias)
        self.shared_experts = SharedMLP(*shared) if shared else None
        self._seed = seed
        self._setup(spec, None, "shared_experts" if shared else None, options, first)

    def reset_parameters(self) -> None:
        """Draw the parameters again, in place, as ``MoE(spec, seed=seed)`` draws them
        (``ExpertWeights.random``; a sharded layer its stored slots' rows): a layer built
        on the meta device (``with torch.device("meta")``) gets its values so after
        ``to_empty``.  A layer over a transformers block is initialised by its model
        (``init_weights``)."""
        if self.family is not None:
            raise TypeError("reset_parameters: this layer holds a transformers block's parameters; "
                            "initialise them through the model (model.init_weights())")
        stored = list(held(self._door.balance)) if self.options.shard_experts else slice(None)
        experts, router, bias, shared = _initial(ExpertWeights.random(self.spec, self._seed), stored)
        gate = (router,) if bias is None else (router, bias)
        drawn = {"experts": experts, "gate": gate, "shared_experts": shared}
        with torch.no_grad():
            for name, values in drawn.items():
                module = getattr(self, name)
                mine = (*module.parameters(), *module.buffers()) if module is not None else ()
                for t, value in zip(mine, values, strict=True):
                    t.copy_(value)

    def _setup(self, spec: MoESpec, family: Family | None, fused_shared: str | None,
               options: RegionOptions, placement: Placement | None = None) -> None:
        # raises, naming them
        ParallelSpec(ep=options.ranks, tokens_per_rank=1, nodes=options.nodes).local_experts(spec)
        self.spec = spec
        self.family = family
        self.fused_shared = fused_shared
        self.options = options
        self._door = Door(spec, options, placement)
        self._weights_cache = WeightsCache(keeps=not options.shard_experts)
        self._computing: int | None = None  # computing experts when some are identity ones
        if options.shard_experts:  # its state dict in logical expert order
            attach(self, self._door.balance, [f"experts.{n}" for n, _ in self.experts.named_parameters()])

    @classmethod
    def from_hf(cls, module: nn.Module, **options: Any) -> MoE:
        """An hpmoe layer over the very submodules of a transformers MoE block of a family in
        ``hpmoe.nn.families.FAMILIES``: parameter objects, names and buffers are unchanged and
        the block's router module routes.  Raises ``TypeError`` for a block of no known family
        and ``ValueError`` naming the family and the feature for one whose maths the region
        does not compute.  ``options``: fields of ``RegionOptions``."""
        if (family := family_of(module)) is None:
            raise TypeError(f"module must be a transformers MoE block of {sorted(f.block for f in FAMILIES)},"
                            f" got {type(module).__name__}")
        checked = RegionOptions(**options)
        if checked.shard_experts:
            raise ValueError("shard_experts=True is for layers built from a spec (MoE(spec, ...)): a "
                             "transformers block keeps its own full-size expert tensors")
        layout = read_block(module, family, checked.virtual_ep)
        register()
        select_experts(getattr(module, "experts", None))
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
        return self._door.session()

    def close(self) -> None:
        """Close the runtime session this layer opened (a shared session stays open): its
        threads and shared segments.  A layer let go without it closes it as the session
        is collected (after the last graph that holds it)."""
        self._door.close()

    def check(self) -> None:
        """Wait for the device and raise what a call found and has not reported yet: an
        input fault (``check="deferred"``, the default: the next call raises what the
        device's scan found), then a ``backend="triton"`` launch's late wait."""
        self._door.check()

    @property
    def last_call(self) -> CallRecord | None:
        """What the last region call ran: its path, tokens per rank, tuning trial."""
        return self._door.last

    @property
    def _layout(self) -> ExpertsLayout:
        return self.family.layout if self.family else ExpertsLayout.FUSED

    def _expert_tensors(self) -> ExpertTensors:
        return expert_tensors(self, self._layout, self._computing)

    def expert_weights(self) -> ExpertWeights:
        """The current parameters as ``ExpertWeights`` in their current dtype, connected to
        autograd: router [E, H] float32 (hpmoe's own router; zeros for a transformers block,
        whose router module routes), w13 [E, 2F, H], w2 [E, H, F] (views of the block's
        expert parameters, or a copy where its layout needs one), shared_w13 = cat(gate, up).
        With ``shard_experts``: the physical layer of this rank's stored slots (router
        placeholders; ``Balance.stored_slots``)."""
        w = self._region_weights()
        if self.options.shard_experts:
            return w
        router, bias = self._router(w.w13.device)
        return replace(w, router=router, router_bias=bias)

    def _region_weights(self) -> ExpertWeights:
        """``expert_weights`` as a region reads them: its router placeholders (a region
        never reads the router; routing is done)."""
        t = self._expert_tensors()
        spec = self._door.logical(t.w13.dtype)
        sh = getattr(self, self.fused_shared) if self.fused_shared else None
        parts = None if sh is None else (sh.gate_proj.weight, sh.up_proj.weight)
        shared = (None, None) if sh is None else (torch.cat(parts), sh.down_proj.weight)
        if self.options.shard_experts:
            stored = [t.w13, t.w2, *((t.b13, t.b2) if t.b13 is not None else ())]
            return self._door.balance.stored_slots(spec, stored, *shared, parts)
        return ExpertWeights.routed(spec, t.w13, t.w2, *shared, t.b13, t.b2, shared_parts=parts)

    def _router(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(router [E, H], score-correction bias [E]) float32: hpmoe's own, or zeros for a
        transformers block (its router module routes)."""
        router, bias = router_placeholders(self.spec.experts, self.spec.hidden, device)
        if self.family is not None:
            return router, bias
        b = getattr(self.gate, "e_score_correction_bias", None)
        return self.gate.weight.float(), bias if b is None else b.float()

    def _gate_weights(self, dtype: torch.dtype) -> ExpertWeights:
        """hpmoe's own router for routing in ``dtype`` (expert tensors: placeholders)."""
        return ExpertWeights.gate_only(self._door.logical(dtype), *self._router(self.gate.weight.device))

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
            dtype = experts_dtype(self, self._layout)
            try:  # x's values are scanned once, by the region call
                routing = route(x.to(dtype), self._gate_weights(dtype), check=False)
            except (ValueError, TypeError) as err:  # every rank must hear of it, in step
                if self.options.distributed:
                    self._door.reject(x.shape[0], self._region_weights(), err)
                raise
            return self.region(x, routing.ids, routing.weights).view(hidden_states.shape)
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
            out = sum(self.region(x * weights[:, j:j + 1].to(x.dtype), ids[:, j:j + 1], ones)
                      for j in range(ids.shape[1]))
        else:
            out = self.region(x, ids, weights)
        return out if identity is None else out + identity

    def region(self, x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The region on a routing made elsewhere: x [N, H] routed by ids [N, k] (logical
        expert ids) with weights [N, k] (any float dtype; combined in fp32) -> the routed
        plus shared experts' output [N, H] in x's dtype; with an ep_group, this rank's
        tokens.  The same front door as ``forward`` (``engine.door``: check, agreement,
        placement, AUTO).  Computes in the experts' dtype, or the autocast dtype; pads the
        batch to equal token counts per (virtual) rank with zero rows of weight 0."""
        return self._door.call(x, ids, topk_weights, self._weights_cache.get(self, self._region_weights))

    def _apply(self, fn: Any, recurse: bool = True) -> MoE:  # .to(), .half(): drop the old storages' weights
        self._weights_cache.clear()
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------ placement

    @property
    def placement(self) -> Placement | None:
        """Which physical slot holds which expert (``hpmoe.placement``); None: expert ``e``
        on rank ``e // (E / ep)``.  Set it (the same on every rank) or let ``rebalance``
        plan it; every rank keeps full-size parameters and optimizer state, so a new
        placement moves nothing.  A layer with ``shard_experts`` moves rows instead:
        ``move_to``."""
        return self._door.balance.placement

    @placement.setter
    def placement(self, placement: Placement | None) -> None:
        self._door.balance.set(placement)

    def move_to(self, placement: Placement | None,
                optimizer: torch.optim.Optimizer | None = None) -> Migration:
        """Adopt ``placement`` (None: the identity; the same on every rank): a layer with
        ``shard_experts`` moves its stored rows between ranks (collective), and with them
        their gradients and every state tensor ``optimizer`` keeps for them (Adam's
        moments); any other layer moves nothing.  Returns what moved, its measured time
        and its modelled time on the layer's hardware model's link."""
        return self._door.balance.move_to(placement, list(self.experts.parameters()), optimizer)

    def expert_load(self) -> np.ndarray:
        """[E] this rank's measured routed rows per expert: an exponential moving average
        over calls (``engine.balance.LOAD_DECAY`` per call)."""
        return self._door.balance.expert_load()

    def rebalance(self, redundant: int = 0, min_gain: float = MIN_REBALANCE_GAIN,
                  optimizer: torch.optim.Optimizer | None = None, steps: int = 0) -> Placement | None:
        """Plan a placement from the measured load of every rank (collective over the
        ep_group): ``redundant`` extra replicas of the most loaded experts, packed onto
        ranks (``plan_placement``, keeping experts where they are).  Adopted only when it
        lowers the busiest rank's predicted load (``rank_loads``) by ``min_gain`` or more —
        on a layer with ``shard_experts``, its predicted seconds a call, replicas' gradient
        all-reduce included — and, with ``steps`` (the calls it would serve until the next
        rebalance), on such a layer only when the move's modelled time is below what it is
        predicted to save over them; ``move_to`` moves ``optimizer``'s state with the rows.
        Returns the placement in effect."""
        stored = list(self.experts.parameters())
        return self._door.balance.rebalance(redundant, stored, min_gain, optimizer, steps)

    def _spec(self, dtype: torch.dtype | None) -> MoESpec:
        return self._door.logical(dtype or experts_dtype(self, self._layout))

    def decision(self, tokens: int, backward: bool | None = None,
                 dtype: torch.dtype | None = None) -> AutoDecision:
        """AUTO's decision for ``tokens`` tokens per call after padding (this rank's, with
        an ep_group; the whole batch in one process), with the backward when ``backward``
        (default: grad mode is on), computing in ``dtype`` (default: the parameters').
        Made at the first call of each shape (collective over the ep_group: group rank 0
        forecasts and broadcasts), then cached."""
        return self._door.decision(self._spec(dtype), tokens, backward)

    def tuned(self, tokens: int, backward: bool | None = None,
              dtype: torch.dtype | None = None) -> TuneResult | None:
        """What AUTO's tuning settled on for ``tokens`` tokens per rank (after padding),
        with the backward when ``backward`` (default: grad mode is on), computing in
        ``dtype`` (default: the parameters'): the winner, its time, the runner-up, the
        kernel-by-kernel path's time and the tuning's cost; None while it is still tuning
        (or the layer does not tune: one process without ``backend='auto'``, a fixed
        schedule, an explicit ``hardware`` model)."""
        return self._door.tuned(self._spec(dtype), tokens, backward, next(self.parameters()).device)

    @property
    def tuning_notes(self) -> tuple[str, ...]:
        """What AUTO's tuning noted: cache entries it ignored, and why."""
        return tuple(self._door.auto.tuner.notes)

    def extra_repr(self) -> str:
        o, family = self.options, self.family
        where = (f"ep_group, schedule={runtime_policy(o).value}" if o.distributed
                 else f"virtual_ep={o.virtual_ep}")
        parts = ([f"family={family.name}"] if family else []) + [f"spec={self.spec}", where]
        parts += [f"backend={o.backend.value}"] if o.backend is not Backend.EXACT else []
        return ", ".join([*parts, f"recompute={o.recompute.value}"] + ["offload=True"] * o.offload)

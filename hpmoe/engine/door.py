"""The call protocol of a layer: every region call of ``hpmoe.MoE`` goes through
``Door.call``, and nothing below it checks, agrees or counts again.

  1. check: the input's form on the host, its values in one scan on its device
     (``InputCheck``: raised in the call, or one call late without a host sync);
  2. agree (an EP group): one all-gather (``Session.open_call``) of what the call is,
     every rank's verdict on its input, token count, tuner figures and rows per expert;
  3. place: the load's moving average, and each row's physical slot (``Balance``);
  4. pad every (virtual) rank to the same token count with rows of weight 0;
  5. select the path (``selection.select``, the one place that chooses);
  6. run it as one autograd node (``paths.run``), which saves what the backward reads;
     the backward node opens the backward call's agreement.

``Door.last`` records what the last call ran (``CallRecord``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..exec.arena import ArenaPool
from ..ir.schedule import SchedulePolicy
from ..placement import Placement
from ..regions.base import RegionKind
from ..routing import Routing, check_form, expert_counts
from ..schedule.auto import AutoDecision
from ..schedule.tune import TuneResult
from ..schedule.tuner import Trial
from ..spec import MoESpec
from ..weights import ExpertWeights
from .balance import Balance
from .check import InputCheck
from .compiled import run_region
from .options import RegionOptions
from .paths import RegionPath, records_backward, run
from .selection import Auto, compiled, decision, select, tuned

if TYPE_CHECKING:  # the runtime is imported on first distributed use, never by ``import hpmoe``
    from ..runtime import Opened, Session


@dataclass(frozen=True)
class CallRecord:
    """What a region call ran: its ``path`` (the path object: which executor, EP degree,
    tiles, policy), its tokens per (virtual) rank after padding, and whether it was a
    tuning trial."""

    path: RegionPath
    tokens: int
    trial: bool


class Door:
    """The front door of one layer of ``spec`` run with ``options``: it owns the
    layer's runtime session (opened at first use), AUTO's memory, scratch arenas,
    input verdicts and placement (``balance``; ``placement``: the one it starts with)."""

    def __init__(self, spec: MoESpec, options: RegionOptions, placement: Placement | None = None):
        self.spec, self.options = spec, options
        self._session, self._owns_session = options.session, False
        self.auto = Auto()
        self.arenas = ArenaPool()
        self.inputs = InputCheck(options.check, spec.experts)
        self.balance = Balance(spec, options, self.session, placement)
        self.last: CallRecord | None = None
        self._specs: dict[torch.dtype, MoESpec] = {}
        self._paths: dict[tuple, CallRecord] = {}

    def __reduce__(self) -> tuple:
        """A copy (``copy.deepcopy`` of a layer, or a pickled one) keeps the placement, the
        load and AUTO's memory; it starts with no runtime session (it opens its own on the
        same EP group at first use), no scratch, no input verdict and no call record (a
        persistent program's state holds tensors with autograd history, which no copy
        may take)."""
        return (Door, (self.spec, self.options), {"auto": self.auto, "balance": self.balance})

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
        """Close the runtime session this door opened (a shared session stays open)."""
        if self._owns_session and self._session is not None:
            self._session.close()
            self._session = None
        self._owns_session = False

    def call(self, x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor,
             w: ExpertWeights) -> torch.Tensor:
        """The region on x [N, H] routed by ids [N, k] (logical expert ids) with weights
        [N, k] over the layer's expert weights ``w`` -> [N, H] in x's dtype, computed in
        the experts' dtype (or the autocast dtype).  Under ``torch.inference_mode()`` the
        call runs outside it, without gradients: what a call keeps for later ones (scratch
        buffers, programs, verdicts, the load) must not be inference tensors, which a
        later call outside inference mode could not write."""
        if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():
                return self._call(x, ids, topk_weights, w)
        return self._call(x, ids, topk_weights, w)

    def _call(self, x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor,
              w: ExpertWeights) -> torch.Tensor:
        dtype = _compute_dtype(x, w.spec.dtype)
        w = w if dtype == w.spec.dtype else _cast(w, dtype)
        # rows laid out one after another: a persistent kernel binds x's storage as rows, and a
        # GEMM on a strided operand rounds otherwise (the same values, other bits)
        xc = _as(x, dtype).contiguous()
        routing = Routing(_as(ids, torch.int64), _as(topk_weights, torch.float32))
        o = self.options
        if compiled(o):
            return _as(self._compiled(xc, routing, w), x.dtype)
        logical = self.logical(dtype)
        if o.distributed:
            routing, opened = self._agreed(xc, routing, w, logical)
            received, tokens = opened.received, opened.tokens
        else:
            routing, received, tokens = self._checked(xc, routing, logical), None, None
        self.balance.measure(routing.counts)
        out = self._placed(xc, routing, w, received, tokens)
        return _as(_unpadded(out, x.shape[0]), x.dtype)

    def reject(self, tokens: int, w: ExpertWeights, error: BaseException) -> None:
        """Report this rank's ``error`` (its gate refused its input) through the call's
        agreement: every rank raises the same ``InputRejected``."""
        self._open(tokens, w, error, None)

    def check(self) -> None:
        """Raise the first input fault that a call found on the device and has not
        reported yet (``CheckMode.DEFERRED``), then a persistent launch's late wait not
        reported yet; waits for the device."""
        self.inputs.check()
        self.arenas.report()

    def logical(self, dtype: torch.dtype) -> MoESpec:
        """The layer's logical spec in ``dtype`` (made once per dtype in eager calls; a
        compiled graph makes its own, reading no state a call would change)."""
        if torch.compiler.is_compiling():
            return replace(self.spec, dtype=dtype)
        spec = self._specs.get(dtype)
        if spec is None:
            spec = self._specs[dtype] = replace(self.spec, dtype=dtype)
        return spec

    def _checked(self, x: torch.Tensor, routing: Routing, spec: MoESpec) -> Routing:
        """One process: the form, then the values' scan settled as the check mode says
        (under ``DEFERRED`` the call runs on ids clamped into range); the rows per expert
        counted."""
        check_form(x, routing, spec)
        ids, counts = self.inputs.settle(x, routing.ids, routing.weights)
        return Routing(ids, routing.weights, counts)

    def _agreed(self, x: torch.Tensor, routing: Routing, w: ExpertWeights, spec: MoESpec
                ) -> tuple[Routing, Opened]:
        """An EP group: this rank's verdict read at once and agreed on with every rank's
        (the rows per expert counted and carried, but under a placement: slots are counted
        after the agreement)."""
        try:
            check_form(x, routing, spec)
            error = self.inputs.error(x, routing.ids, routing.weights)
        except (ValueError, TypeError) as err:
            error = err
        rows = expert_counts(routing.ids, spec.experts) if error is None else None
        backward = error is None and records_backward(x, routing.weights, w)
        opened = self._open(x.shape[0] if isinstance(x, torch.Tensor) else 0, w, error,
                            rows if self.balance.placement is None else None, backward)
        return Routing(routing.ids, routing.weights, rows), opened

    def _open(self, tokens: int, w: ExpertWeights, error: BaseException | None,
              sent: torch.Tensor | None, backward: bool = False) -> Opened:
        """The agreement that opens a distributed call, before any other collective of
        it; it carries the tuner's figures (its trial's time), and observes every rank's;
        ``backward``: the call records a backward."""
        s, tuner = self.session(), self.auto.tuner
        p = self.balance.placement
        opened = s.open_call(RegionKind.FORWARD, w, self.options.tiles, tokens, error, tuner.report(),
                             tuner.digest(), p.digest() if p is not None else 0, sent, backward)
        tuner.observe(opened.figures[:, 0].tolist(), opened.figures[:, 1].tolist(), s.rank)
        return opened

    def _placed(self, x: torch.Tensor, routing: Routing, w: ExpertWeights, received: torch.Tensor | None,
                tokens: list[int] | None) -> torch.Tensor:
        """Steps 3-6 of a call whose input is checked (and agreed: ``tokens``, every
        rank's count)."""
        o = self.options
        padded = max(max(tokens), 1) if tokens is not None else self._padded(x.shape[0])
        if self.balance.placement is not None:  # slots are counted after the agreement
            routing, w, received = *self.balance.place(routing, w, padded, tokens), None
        xp, routing = _pad(x, routing, padded, w.spec, o.virtual_ep, o.group)
        s = self.session()
        with _no_autocast(x.device.type):
            self.last, trial = self._select(w.spec, padded, x.device, received)
            return run(self.last.path, xp, routing, w, trial, self.balance.own_slots(), self.balance.clock, s,
                       o.tiles, o.offload)

    def _padded(self, tokens: int) -> int:
        """One process: ``tokens`` rounded up to a multiple of the virtual ranks (one at least)."""
        ranks = self.options.virtual_ep
        return max(-(-tokens // ranks), 1) * ranks

    def _select(self, spec: MoESpec, tokens: int, device: torch.device,
                received: torch.Tensor | None) -> tuple[CallRecord, Trial | None]:
        """``selection.select``, as the call's record; in one process a choice that is not
        a tuning trial is kept per (layer, tokens, grad mode, device) and looked up at later
        calls."""
        key = spec, tokens, torch.is_grad_enabled(), device
        if (record := self._paths.get(key)) is not None:
            return record, None
        path, trial = select(self.options, spec, tokens, self.auto, self.session(), self.arenas, device,
                             received)
        record = CallRecord(path, tokens, trial is not None and trial.tuning)
        if trial is None and not self.options.distributed:
            self._paths[key] = record
        return record, trial

    def _compiled(self, x: torch.Tensor, routing: Routing, w: ExpertWeights) -> torch.Tensor:
        """Under ``torch.compile`` in one process: the region's custom op (``compiled``),
        which checks its input itself; AUTO decides on the saved profile alone."""
        o, n = self.options, x.shape[0]
        padded = self._padded(n)
        routing, w = self.balance.place(routing, w, padded, None)
        xp, routing = _pad(x, routing, padded, w.spec, o.virtual_ep, None)
        auto = o.schedule is SchedulePolicy.AUTO
        out = run_region(xp, routing.ids, routing.weights, w.gathered(), o.virtual_ep, o.tiles, auto,
                         o.nodes)
        return _unpadded(out, n)

    def decision(self, spec: MoESpec, tokens: int, backward: bool | None) -> AutoDecision:
        """AUTO's forecast for a call of ``tokens`` tokens computing ``spec`` (``MoE.decision``;
        ``backward`` None: whether grad mode is on)."""
        backward = torch.is_grad_enabled() if backward is None else backward
        return decision(self.options, self.balance.region_spec(spec), tokens, backward, self.auto,
                        self.session())

    def tuned(self, spec: MoESpec, tokens: int, backward: bool | None,
              device: torch.device) -> TuneResult | None:
        """What AUTO's tuning settled on (``MoE.tuned``; ``backward`` None: whether grad
        mode is on)."""
        backward = torch.is_grad_enabled() if backward is None else backward
        return tuned(self.options, self.balance.region_spec(spec), tokens, backward, self.auto,
                     self.session(), device)


def _compute_dtype(x: torch.Tensor, weights_dtype: torch.dtype) -> torch.dtype:
    """The autocast dtype inside ``torch.autocast``, else the expert weights' dtype."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weights_dtype


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: itself where it is already (``Tensor.to`` is a dispatch even then)."""
    return t if t.dtype == dtype else t.to(dtype)


def _no_autocast(device: str) -> contextlib.AbstractContextManager:
    """Autocast off for the region (it computes in its own dtypes); nothing to enter where
    it is off already."""
    if torch.is_autocast_enabled(device):
        return torch.autocast(device, enabled=False)
    return contextlib.nullcontext()


def _cast(w: ExpertWeights, dtype: torch.dtype) -> ExpertWeights:
    """``w`` with its expert tensors cast to ``dtype`` (differentiably)."""
    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype)

    return ExpertWeights(replace(w.spec, dtype=dtype), w.router, w.router_bias, cast(w.w13), cast(w.w2),
                         cast(w.shared_w13), cast(w.shared_w2), cast(w.b13), cast(w.b2), w.slot_rows)


def _unpadded(out: torch.Tensor, tokens: int) -> torch.Tensor:
    """The first ``tokens`` rows of a padded call's ``out``; ``out`` itself when nothing
    was padded (a slice would cost its backward a zero-filled copy of the gradient)."""
    return out if out.shape[0] == tokens else out[:tokens]


def _pad(x: torch.Tensor, routing: Routing, total: int, spec: MoESpec, virtual_ep: int,
         group: object) -> tuple[torch.Tensor, Routing]:
    """Append ``total - N`` zero tokens of routing weight 0, each routed to the first local
    expert of the rank that holds it: no communication, an expert output of exactly 0, and
    nothing added to any gradient (the rows per expert are then not the routing's)."""
    ids, weights = routing.ids, routing.weights
    n, k = ids.shape
    if total == n:
        return x, routing
    ranks = virtual_ep if group is None else dist.get_world_size(group)
    local = max(spec.experts // ranks, 1)
    pos = torch.arange(n, total, device=ids.device)
    owner = pos // (total // ranks) if group is None else torch.full_like(pos, dist.get_rank(group))
    pad_ids = (owner * local).clamp(max=spec.experts - 1).unsqueeze(1).expand(total - n, k)
    return (torch.cat([x, x.new_zeros(total - n, x.shape[1])]),
            Routing(torch.cat([ids, pad_ids]), torch.cat([weights, weights.new_zeros(total - n, k)])))

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

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..exec.arena import ArenaPool
from ..exec.backend import Backend
from ..ir.schedule import SchedulePolicy
from ..placement import Placement
from ..regions.base import RegionKind
from ..routing import Routing, check_form, expert_counts
from ..schedule.auto import AutoDecision
from ..schedule.tune import TuneResult
from ..spec import MoESpec
from ..weights import ExpertWeights
from .balance import Balance
from .check import CheckMode, InputCheck
from .compiled import run_region
from .options import RegionOptions
from .paths import RegionPath, run
from .selection import Auto, decision, select, tuned

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
        the experts' dtype (or the autocast dtype)."""
        dtype = _compute_dtype(x, w.spec.dtype)
        w = w if dtype == w.spec.dtype else _cast(w, dtype)
        xc, routing = x.to(dtype), Routing(ids.to(torch.int64), topk_weights.float())
        o = self.options
        if torch.compiler.is_compiling() and not o.distributed and o.backend is Backend.EXACT:
            return self._compiled(xc, routing, w).to(x.dtype)
        logical = replace(self.spec, dtype=dtype)
        if o.distributed:
            routing, rows, received, tokens = self._agreed(xc, routing, w, logical)
        else:
            routing, rows, received, tokens = self._checked(xc, routing, logical), None, None, None
            rows = expert_counts(routing.ids, self.spec.experts)
        self.balance.measure(rows)
        out = self._placed(xc, routing, w, rows, received, tokens)
        return out[:x.shape[0]].to(x.dtype)

    def reject(self, tokens: int, w: ExpertWeights, error: BaseException) -> None:
        """Report this rank's ``error`` (its gate refused its input) through the call's
        agreement: every rank raises the same ``InputRejected``."""
        self._open(tokens, w, error, None)

    def check(self) -> None:
        """Raise the first input fault that a call found on the device and has not
        reported yet (``CheckMode.DEFERRED``); waits for the device."""
        self.inputs.check()

    def _checked(self, x: torch.Tensor, routing: Routing, spec: MoESpec) -> Routing:
        """One process: the form, then the values' scan settled as the check mode says;
        under ``DEFERRED`` the call runs on ids clamped into range."""
        check_form(x, routing, spec)
        self.inputs.settle(self.inputs.scan(x, routing.ids, routing.weights))
        if self.inputs.mode is CheckMode.DEFERRED:
            return Routing(routing.ids.clamp(0, spec.experts - 1), routing.weights)
        return routing

    def _agreed(self, x: torch.Tensor, routing: Routing, w: ExpertWeights, spec: MoESpec
                ) -> tuple[Routing, torch.Tensor, torch.Tensor | None, list[int]]:
        """An EP group: this rank's verdict read at once and agreed on with every
        rank's; (routing, rows per expert, rows each rank sends this one's experts
        (None under a placement: slots are counted after the agreement), every rank's
        token count)."""
        try:
            check_form(x, routing, spec)
            error = self.inputs.error(self.inputs.scan(x, routing.ids, routing.weights))
        except (ValueError, TypeError) as err:
            error = err
        rows = expert_counts(routing.ids, spec.experts) if error is None else None
        opened = self._open(x.shape[0] if isinstance(x, torch.Tensor) else 0, w, error,
                            rows if self.balance.placement is None else None)
        return routing, rows, opened.received, opened.tokens

    def _open(self, tokens: int, w: ExpertWeights, error: BaseException | None,
              sent: torch.Tensor | None) -> Opened:
        """The agreement that opens a distributed call, before any other collective of
        it; it carries the tuner's figures (its trial's time), and observes every rank's."""
        s, tuner = self.session(), self.auto.tuner
        p = self.balance.placement
        opened = s.open_call(RegionKind.FORWARD, w, self.options.tiles, tokens, error, tuner.report(),
                             tuner.digest(), p.digest() if p is not None else 0, sent)
        tuner.observe(opened.figures[:, 0].tolist(), opened.figures[:, 1].tolist(), s.rank)
        return opened

    def _placed(self, x: torch.Tensor, routing: Routing, w: ExpertWeights, rows: torch.Tensor,
                received: torch.Tensor | None, tokens: list[int] | None) -> torch.Tensor:
        """Steps 3-6 of a call whose input is checked (and agreed: ``tokens``, every
        rank's count)."""
        o, n = self.options, x.shape[0]
        index = torch.arange(n, device=routing.ids.device)
        if tokens is not None:
            rank = self.session().rank
            padded, token_rank, first = max(max(tokens), 1), torch.full_like(index, rank), sum(tokens[:rank])
        else:
            padded = max(-(-n // o.virtual_ep), 1) * o.virtual_ep
            token_rank, first = index // (padded // o.virtual_ep), 0
        ids, w = self.balance.place(routing.ids, w, token_rank, first + index)
        placed = self.balance.placement is not None
        received = None if placed else received  # slots are counted after the agreement
        sent = rows if not placed and padded == n else None  # pad rows are rows too
        xp, idp, wp = _pad(x, ids, routing.weights, padded, w.spec, o.virtual_ep, o.group)
        s = self.session()
        with torch.autocast(x.device.type, enabled=False):
            path, trial = select(o, w.spec, xp.shape[0], self.auto, s, self.arenas, x.device, received, sent)
            self.last = CallRecord(path, xp.shape[0], trial is not None and trial.tuning)
            return run(path, xp, Routing(idp, wp), w, trial, self.balance.own_slots(), self.balance.clock, s,
                       o.tiles)

    def _compiled(self, x: torch.Tensor, routing: Routing, w: ExpertWeights) -> torch.Tensor:
        """Under ``torch.compile`` in one process: the region's custom op (``compiled``),
        which checks its input itself; AUTO decides on the saved profile alone."""
        o, n = self.options, x.shape[0]
        padded = max(-(-n // o.virtual_ep), 1) * o.virtual_ep
        index = torch.arange(n, device=routing.ids.device)
        ids, w = self.balance.place(routing.ids, w, index // (padded // o.virtual_ep), index)
        xp, idp, wp = _pad(x, ids, routing.weights, padded, w.spec, o.virtual_ep, None)
        auto = o.schedule is SchedulePolicy.AUTO
        return run_region(xp, idp, wp, w.gathered(), o.virtual_ep, o.tiles, auto, o.nodes)[:n]

    def decision(self, spec: MoESpec, tokens: int, backward: bool) -> AutoDecision:
        """AUTO's forecast for a call of ``tokens`` tokens computing ``spec`` (``MoE.decision``)."""
        return decision(self.options, self.balance.region_spec(spec), tokens, backward, self.auto,
                        self.session())

    def tuned(self, spec: MoESpec, tokens: int, backward: bool, device: torch.device) -> TuneResult | None:
        """What AUTO's tuning settled on (``MoE.tuned``)."""
        return tuned(self.options, self.balance.region_spec(spec), tokens, backward, self.auto,
                     self.session(), device)


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
                         cast(w.shared_w13), cast(w.shared_w2), cast(w.b13), cast(w.b2), w.slot_rows)


def _pad(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, total: int, spec: MoESpec,
         virtual_ep: int, group: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

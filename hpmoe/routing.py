"""Routing: gates that turn hidden states into top-k expert choices, the
``RoutingPlan`` that every later stage reads, and synthetic routings for benchmarks.

The plan is built as MegaBlocks builds its routing state: sort → histogram → cumsum,
all plain integer tensors.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .spec import GateKind, MoESpec, ParallelSpec
from .weights import ExpertWeights


@dataclass(frozen=True)
class Routing:
    """Top-k choices of N tokens.

    ids:     [N, k] int64 — global expert ids in top-k slot order.
    weights: [N, k] float32 — combine weights in the same order.
    counts:  [E] int64 rows routed to each expert (``expert_counts(ids)``), where the
             caller has counted them already; None: not counted.
    """

    ids: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.ids.shape[0]


def check_routing(routing: Routing, spec: MoESpec, tokens: int) -> None:
    """Raise ``ValueError``/``TypeError`` naming the field when ``routing`` does not fit."""
    _check_routing_form(routing, spec, tokens)
    _check_values(spec, ids=routing.ids, weights=routing.weights)


def check_ids(ids: object, spec: MoESpec, tokens: int) -> None:
    """``ids`` must be ``[tokens, top_k]`` int64 expert ids in ``[0, experts)``."""
    _check_ids_form(ids, spec, tokens)
    _check_values(spec, ids=ids)


def check_hidden(x: object, spec: MoESpec, name: str = "x") -> None:
    """``x`` must be a finite ``[N, hidden]`` tensor of ``spec.dtype``."""
    _check_hidden_form(x, spec, name)
    _check_values(spec, x, name)


def check_input(x: object, routing: Routing, spec: MoESpec, name: str = "x") -> None:
    """``check_hidden`` and ``check_routing`` of one call: the value checks (finite x
    and weights, ids in range) in one device round trip, where the two made three."""
    check_form(x, routing, spec, name)
    _check_values(spec, x, name, routing.ids, routing.weights)


def check_form(x: object, routing: Routing, spec: MoESpec, name: str = "x") -> None:
    """The types, shapes and dtypes of ``check_input``, read on the host alone."""
    _check_hidden_form(x, spec, name)
    _check_routing_form(routing, spec, x.shape[0])


def _check_ids_form(ids: object, spec: MoESpec, tokens: int) -> None:
    shape = (tokens, spec.top_k)
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
        raise TypeError(f"routing.ids must be an int64 tensor, got {getattr(ids, 'dtype', type(ids))}")
    if tuple(ids.shape) != shape:
        raise ValueError(f"routing.ids has shape {tuple(ids.shape)}, expected {shape}")


def _check_routing_form(routing: Routing, spec: MoESpec, tokens: int) -> None:
    _check_ids_form(routing.ids, spec, tokens)
    w = routing.weights
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float32:
        raise TypeError(f"routing.weights must be a float32 tensor, got {getattr(w, 'dtype', type(w))}")
    if tuple(w.shape) != tuple(routing.ids.shape):
        raise ValueError(f"routing.weights has shape {tuple(w.shape)}, expected {tuple(routing.ids.shape)}")


def _check_hidden_form(x: object, spec: MoESpec, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != spec.hidden:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected [tokens, {spec.hidden}]")
    if x.dtype != spec.dtype:
        raise TypeError(f"{name} has dtype {x.dtype}, expected {spec.dtype} (MoESpec.dtype)")


def _check_values(spec: MoESpec, x: torch.Tensor | None = None, name: str = "x",
                  ids: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> None:
    """Raise the error ``value_error`` finds in x, ids and weights (each where given)."""
    if torch.compiler.is_compiling():  # no data-dependent branch in a compiled graph
        return
    error = value_error(spec.experts, x, ids, weights, name)
    if error is not None:
        raise error


def value_error(experts: int, x: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                weights: torch.Tensor | None = None, name: str = "x") -> ValueError | None:
    """The first fault of x (non-finite rows), ids (outside ``[0, experts)``) and weights
    (non-finite), each where given, or None; only a fault costs the scan that names its
    row (``input_status``).  A CPU reads each at once (no device to wait for): a float
    tensor's sum, finite unless it holds a NaN or inf (or overflows: the scan then finds
    nothing), and the ids' (min, max); a device's (min, max) of each (``aminmax``
    propagates NaN) stacked in float64, which holds every expert id exactly, in one read."""
    named = [t for t in (x, ids, weights) if t is not None and t.numel()]
    if not named:
        return None
    if named[0].is_cpu:
        clean = all(_clean_on_cpu(t, experts) for t in named)
    else:  # detached: a verdict keeps no history of x (cheaper than entering no_grad)
        spans = [m for t in named for m in torch.aminmax(bare(t))]
        lo_hi = torch.stack([spans[0].double(), *spans[1:]]).tolist()
        clean = all(map(math.isfinite, lo_hi))  # expert ids are always finite
        if any(t is ids for t in named):
            at = 2 * [t is ids for t in named].index(True)
            clean = clean and lo_hi[at] >= 0 and lo_hi[at + 1] < experts
    if clean:
        return None
    return status_error(input_status(experts, x, ids, weights).tolist(), experts, name)


def bare(t: torch.Tensor) -> torch.Tensor:
    """``t`` without autograd history: ``t`` itself where it records none (a ``detach`` is
    an operator dispatch, a small call's host time)."""
    return t.detach() if t.requires_grad else t


def _clean_on_cpu(t: torch.Tensor, experts: int) -> bool:
    """A CPU tensor's values pass: floats sum to a finite value (fp16 summed in fp32, whose
    range a sum of finite values rarely leaves), integers lie in ``[0, experts)``."""
    if t.is_floating_point():
        return math.isfinite(bare(t).sum(dtype=torch.float32 if t.dtype == torch.float16 else None).item())
    lo, hi = torch.aminmax(t)
    return lo.item() >= 0 and hi.item() < experts


class InputFault(enum.IntEnum):
    """What the scan of a call's input found first, in the order it checks: x, then the
    expert ids, then the routing weights (``input_status``)."""

    NONE = 0
    X_NAN = 1  # a row of x holds a NaN
    X_INF = 2  # a row of x holds an inf (and no NaN)
    EXPERT_ID = 3  # an expert id outside [0, experts)
    WEIGHTS = 4  # a routing weight is NaN or inf


@torch.no_grad()
def input_status(experts: int, x: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [3] on the inputs' device, computed there without a host read: (the first
    ``InputFault``, x's first non-finite row, the out-of-range expert id: the lowest when
    one is negative, else the highest).  x [N, H], ids [N, k], weights [N, k], each
    optional; empty ones hold no fault.  ``status_error`` reads it."""
    given = [t for t in (x, ids, weights) if t is not None]
    zero = torch.zeros((), dtype=torch.int64, device=given[0].device if given else "cpu")
    fault, row, value = zero, zero, zero
    if weights is not None and weights.numel():
        fault = torch.where(torch.isfinite(weights).all(), fault, int(InputFault.WEIGHTS))
    if ids is not None and ids.numel():
        lo, hi = torch.aminmax(ids)
        value = torch.where(lo < 0, lo, hi).to(torch.int64)
        fault = torch.where((lo < 0) | (hi >= experts), int(InputFault.EXPERT_ID), fault)
    if x is not None and x.numel():
        bad = ~torch.isfinite(x).all(dim=1)
        row = bad.to(torch.uint8).argmax()  # the first bad row (argmax takes the first maximum)
        at = row.view(1)  # indexing with a tensor, not a Python number: no host read
        kind = torch.where(torch.isnan(x.index_select(0, at)).any(), int(InputFault.X_NAN),
                           int(InputFault.X_INF))
        fault = torch.where(bad.index_select(0, at)[0], kind, fault)
    return torch.stack([fault, row, value])


@dataclass(frozen=True)
class Scanned:
    """A call's input scan on its device: its verdict ``status`` int64 [3]
    (``input_status``), the expert ids clamped into ``[0, experts)`` [N, k] int64, and
    their rows per expert [E] int64."""

    status: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor


def status_error(status: Sequence[int], experts: int, name: str = "x") -> ValueError | None:
    """The error an ``input_status`` read on the host names (None: no fault): the field,
    the row or the value (``experts``: the ids' range; ``name``: x's)."""
    fault, row, value = (int(v) for v in status)
    if fault in (InputFault.X_NAN, InputFault.X_INF):
        return ValueError(f"{name} has {'NaN' if fault == InputFault.X_NAN else 'inf'} at row {row}")
    if fault == InputFault.EXPERT_ID:
        return ValueError(f"routing.ids contains expert id {value}, outside [0, {experts})")
    if fault == InputFault.WEIGHTS:
        return ValueError("routing.weights contains NaN or inf")
    return None


def cpu_expert_counts(ids: torch.Tensor, experts: int) -> torch.Tensor | None:
    """A CPU's int64 [experts] rows routed to each expert, counted by ``bincount``, which
    reads the ids' range on the way: None where an id lies outside ``[0, experts)`` (a
    negative one it refuses, a larger one it counts past ``experts``)."""
    try:
        counts = torch.bincount(ids.reshape(-1), minlength=experts)
    except RuntimeError:  # "bincount only supports 1-d non-negative integral inputs"
        return None
    return counts if counts.shape[0] == experts else None


def expert_counts(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """int64 [experts] rows routed to each expert (ids in range): ``bincount`` without its
    two device syncs on CUDA (a scatter-add of ones; integer sums, so exact in any order)."""
    flat = ids.reshape(-1)
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def input_error(x: object, routing: Routing, spec: MoESpec) -> BaseException | None:
    """What is wrong with this rank's ``x`` ([T, H] spec.dtype) and ``routing``
    ([T, k]), or None: a rank's verdict on its own input, for the agreement that opens
    a distributed call."""
    try:
        check_input(x, routing, spec)
    except (ValueError, TypeError) as err:
        return err
    return None


# ---------------------------------------------------------------------------- gates

def route(x: torch.Tensor, weights: ExpertWeights, check: bool = True) -> Routing:
    """Run the gate of ``weights.spec`` on ``x`` ([N, H], spec.dtype).

    Same semantics as transformers' ``DeepseekV3TopkRouter`` (sigmoid) and
    ``Qwen3MoeTopKRouter`` (softmax); the weights are differentiable with respect
    to ``x`` and the router parameters.  check: raise for non-finite x here (a host
    read); a layer's call protocol scans x itself (``engine.check``).
    """
    spec = weights.spec
    if check:
        check_hidden(x, spec)
    else:
        _check_hidden_form(x, spec, "x")
    logits = x.float() @ weights.router.t()
    if spec.gate is GateKind.SIGMOID:
        scores = logits.sigmoid()
        choice = scores + weights.router_bias
    else:
        scores = logits.softmax(dim=-1)
        choice = scores
    choice = _mask_groups(choice.detach(), spec)
    ids = torch.topk(choice, spec.top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if spec.norm_topk:
        eps = 1e-20 if spec.gate is GateKind.SIGMOID else 0.0
        w = w / (w.sum(dim=-1, keepdim=True) + eps)
    return Routing(ids=ids, weights=w * spec.routed_scaling)


def _mask_groups(choice: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """Keep only the experts of each token's ``top_groups`` best groups."""
    if spec.groups == 1:
        return choice
    grouped = choice.view(choice.shape[0], spec.groups, spec.experts // spec.groups)
    if spec.gate is GateKind.SIGMOID:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(spec.top_groups, dim=-1).indices, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)


# ---------------------------------------------------------------------------- plan

@dataclass(frozen=True)
class RoutingPlan:
    """Where every (token, slot) row goes, for ``ep`` ranks of ``tokens_per_rank`` tokens.

    Send side (per source rank s, rows of its permuted buffer sorted by global expert):
      order[s]:        [T*k] int64 — flat index ``t*k + j`` of the row at each position.
      pos[s]:          [T, k] int64 — position of (t, j) in the permuted buffer.
      send_offsets[s]: [ep*L + 1] int64 — start of segment (d, e) is ``[d*L + e]``.
    Receive side (per destination rank d, rows grouped by local expert, then source):
      recv_offsets[d]: [L*ep + 1] int64 — start of segment (e, s) is ``[e*ep + s]``.
    counts: [ep (src), ep (dst), L] int64 — rows source s sends to expert e of rank d.
    """

    moe: MoESpec
    par: ParallelSpec
    order: torch.Tensor
    pos: torch.Tensor
    counts: torch.Tensor
    send_offsets: torch.Tensor
    recv_offsets: torch.Tensor

    @property
    def local_experts(self) -> int:
        return self.counts.shape[2]

    def recv_rows(self, rank: int) -> int:
        return int(self.recv_offsets[rank, -1])

    def expert_rows(self, rank: int) -> torch.Tensor:
        """[L] int64 — rows each local expert of ``rank`` receives."""
        return self.counts[:, rank, :].sum(dim=0)


def plan_routing(ids: torch.Tensor, moe: MoESpec, par: ParallelSpec, checked: bool = False) -> RoutingPlan:
    """Build the plan from top-k ids ``[ep * tokens_per_rank, k]`` (int64); ``checked``:
    the caller has scanned their values (a layer's call), so only their form is checked.

    1. sort each rank's (token, slot) rows by global expert (stable radix sort on
       small keys: token order is kept within an expert);
    2. histogram rows per (source, destination, local expert);
    3. exclusive cumsums give send and receive offsets.
    """
    ep, tpr, k = par.ep, par.tokens_per_rank, moe.top_k
    local = par.local_experts(moe)
    if checked:
        _check_ids_form(ids, moe, ep * tpr)
    else:
        check_ids(ids, moe, ep * tpr)
    flat = ids.numpy().reshape(ep, tpr * k)
    order = np.argsort(flat.astype(np.uint8 if moe.experts <= 256 else np.uint16), axis=1, kind="stable")
    row_base = (np.arange(ep) * tpr * k)[:, None]
    pos = np.empty(ep * tpr * k, np.int64)
    pos[(order + row_base).ravel()] = np.tile(np.arange(tpr * k), ep)
    hist = np.bincount((flat + (np.arange(ep) * moe.experts)[:, None]).ravel(),
                       minlength=ep * moe.experts).reshape(ep, moe.experts)
    counts = torch.from_numpy(hist).view(ep, ep, local)
    recv = counts.permute(1, 2, 0).reshape(ep, local * ep)  # [d, e*ep + s]
    return RoutingPlan(moe=moe, par=par, order=torch.from_numpy(order),
                       pos=torch.from_numpy(pos).view(ep, tpr, k), counts=counts,
                       send_offsets=_exclusive_cumsum(torch.from_numpy(hist)),
                       recv_offsets=_exclusive_cumsum(recv))


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], x.shape[1] + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(x, dim=1, out=out[:, 1:])
    return out


# ---------------------------------------------------------------------------- synthetic

class RoutingKind(enum.Enum):
    """Synthetic routing patterns for benchmarks and tests."""

    BALANCED = "balanced"  # every expert gets the same number of rows (when E divides N*k)
    ZIPF = "zipf"  # expert popularity ~ 1 / rank^1.2, random ranking
    HOT = "hot"  # every token sends its first slot to one expert
    EMPTY_EXPERTS = "empty-experts"  # only even-numbered experts are ever chosen
    EMPTY_RANK = "empty-rank"  # no token chooses an expert of the last rank
    GROUPED = "grouped"  # DeepSeek-V3 group-limited top-k over random scores (MoESpec groups)


def synthetic_routing(kind: RoutingKind, moe: MoESpec, par: ParallelSpec, seed: int = 0) -> Routing:
    """Top-k ids and positive weights (summing to ``routed_scaling``) for every token."""
    n, k, e = par.ep * par.tokens_per_rank, moe.top_k, moe.experts
    g = torch.Generator().manual_seed(seed)
    if kind is RoutingKind.BALANCED:
        start = torch.randint(0, e, (1,), generator=g, device=g.device)
        ids = (start + torch.arange(n * k, device=g.device).view(n, k)) % e
    elif kind is RoutingKind.GROUPED:
        ids = _grouped_top_k(moe, n, g)
    else:
        ids = _sample_distinct(_log_popularity(kind, moe, par, g), n, k, g)
    w = torch.rand(n, k, generator=g, device=g.device) + 0.1
    w = w / w.sum(dim=1, keepdim=True) * moe.routed_scaling
    return Routing(ids=ids.to(torch.int64), weights=w)


def _grouped_top_k(moe: MoESpec, n: int, g: torch.Generator) -> torch.Tensor:
    """[n, k] ids chosen as DeepSeek-V3's router chooses (``_mask_groups``, then top-k),
    from i.i.d. uniform scores: each token keeps the experts of its ``top_groups`` best
    groups out of ``groups`` (group score: sum of its top-2 scores under a sigmoid gate,
    its best score under softmax)."""
    scores = torch.rand(n, moe.experts, generator=g, device=g.device)
    return torch.topk(_mask_groups(scores, moe), moe.top_k, dim=-1).indices


def ranks_per_token(ids: torch.Tensor, moe: MoESpec, par: ParallelSpec) -> float:
    """Mean number of distinct EP ranks each token's top-k experts live on (ids [N, k])."""
    owner = ids // par.local_experts(moe)
    distinct = (owner.sort(dim=1).values.diff(dim=1) != 0).sum(dim=1) + 1
    return float(distinct.double().mean()) if ids.shape[0] else 0.0


def _log_popularity(kind: RoutingKind, moe: MoESpec, par: ParallelSpec,
                    g: torch.Generator) -> torch.Tensor:
    e, k = moe.experts, moe.top_k
    logp = torch.zeros(e, device=g.device)
    if kind is RoutingKind.ZIPF:
        rank = torch.randperm(e, generator=g, device=g.device).double() + 1
        logp = (-1.2 * rank.log()).float()
    elif kind is RoutingKind.HOT:
        logp[0] = 1e4  # always picked first
    elif kind is RoutingKind.EMPTY_EXPERTS:
        _need_allowed(k, (e + 1) // 2, kind)
        logp[1::2] = float("-inf")
    elif kind is RoutingKind.EMPTY_RANK:
        local = par.local_experts(moe)
        _need_allowed(k, e - local, kind)
        logp[e - local:] = float("-inf")
    return logp


def _need_allowed(k: int, allowed: int, kind: RoutingKind) -> None:
    if allowed < k:
        raise ValueError(f"routing kind {kind.value!r} leaves {allowed} experts, fewer than top_k={k}")


def _sample_distinct(logp: torch.Tensor, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """k distinct experts per token, drawn ∝ exp(logp) (Gumbel top-k), best first."""
    u = torch.rand(n, logp.numel(), generator=g, device=g.device)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-12)))
    return torch.topk(logp + gumbel, k, dim=1).indices

"""Expert weights of one MoE layer, in the layout transformers uses.

Routed experts are stored fused, as in transformers' ``DeepseekV3Experts`` and
``Qwen3MoeExperts``: ``w13[e]`` is ``[2F, H]`` with the gate projection in rows
``[0, F)`` and the up projection in rows ``[F, 2F)``; ``w2[e]`` is ``[H, F]``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from .spec import GateKind, MoESpec

Rows = torch.Tensor | tuple[torch.Tensor, ...]
"""Rows of expert tensors indexed by expert (``rows[e]``): a [L, ...] tensor, or a tuple
of L row views of a stored tensor (experts reading slot rows in place)."""

GRADIENT_FIELDS = ("dw13", "dw2", "db13", "db2")  # the expert tensors' gradients, as regions name them


@dataclass
class ExpertWeights:
    """All parameters of a routed + shared MoE layer.

    router:      [E, H] float32 — gate projection (logits = x @ router.T).
    router_bias: [E]    float32 — score-correction bias (sigmoid gate; zeros otherwise).
    w13:         [E, 2F, H] spec.dtype — fused gate/up projections.
    w2:          [E, H, F]  spec.dtype — down projections.
    shared_w13:  [2Fs, H] spec.dtype or None — fused shared-expert gate/up.
    shared_w2:   [H, Fs]  spec.dtype or None — shared-expert down projection.
    b13:         [E, 2F] spec.dtype or None — up-projection biases (``spec.expert_bias``).
    b2:          [E, H]  spec.dtype or None — down-projection biases (``spec.expert_bias``).
    slot_rows:   None, or the row of w13/w2/b13/b2 each expert reads in place (a physical
                 layer of replicas over its logical experts' rows: [R, ...] tensors, R =
                 max(slot_rows) + 1; -1: not stored here, a rank holding only its own
                 slots); ``gathered`` copies them out.  Only paths that say
                 ``reads_slots`` take it.
    shared_parts: None, or (gate [Fs, H], up [Fs, H]) whose concatenation shared_w13 is
                 (a shared expert stored as two projections): a region keeps these for
                 its backward and fuses them again there, not the call's fused copy.
    """

    spec: MoESpec
    router: torch.Tensor
    router_bias: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    shared_w13: torch.Tensor | None = None
    shared_w2: torch.Tensor | None = None
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    slot_rows: tuple[int, ...] | None = None
    shared_parts: tuple[torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        s = self.spec
        fs, rows = s.shared_ffn, self._stored_rows()
        expected = {
            "router": (self.router, (s.experts, s.hidden), torch.float32),
            "router_bias": (self.router_bias, (s.experts,), torch.float32),
            "w13": (self.w13, (rows, 2 * s.ffn, s.hidden), s.dtype),
            "w2": (self.w2, (rows, s.hidden, s.ffn), s.dtype),
        }
        if fs:
            expected["shared_w13"] = (self.shared_w13, (2 * fs, s.hidden), s.dtype)
            expected["shared_w2"] = (self.shared_w2, (s.hidden, fs), s.dtype)
        elif self.shared_w13 is not None or self.shared_w2 is not None:
            raise ValueError("ExpertWeights.shared_w13/shared_w2 given but spec.shared_experts=0")
        if s.expert_bias:
            expected["b13"] = (self.b13, (rows, 2 * s.ffn), s.dtype)
            expected["b2"] = (self.b2, (rows, s.hidden), s.dtype)
        elif self.b13 is not None or self.b2 is not None:
            raise ValueError("ExpertWeights.b13/b2 given but spec.expert_bias=False")
        for name, (tensor, shape, dtype) in expected.items():
            _check_tensor(f"ExpertWeights.{name}", tensor, shape, dtype)

    def _stored_rows(self) -> int:
        """Rows of the expert tensors: one per expert, or as many as ``slot_rows`` reads."""
        rows = self.slot_rows
        if rows is None:
            return self.spec.experts
        lowest = min(rows, default=0)
        if len(rows) != self.spec.experts or lowest < -1:
            raise ValueError(f"ExpertWeights.slot_rows must give a row >= 0 (or -1: not stored) for each "
                             f"of the {self.spec.experts} experts, got {len(rows)} rows, lowest {lowest}")
        return max(rows, default=-1) + 1

    def rows_of(self, experts: slice) -> tuple[int, ...]:
        """The expert-tensor row each of ``experts`` reads."""
        if self.slot_rows is None:
            return tuple(range(self.spec.experts))[experts]
        return self.slot_rows[experts]

    def local(self, experts: slice) -> LocalExperts:
        """What ``experts`` read, in place, indexed by expert from 0: their rows of w13, w2
        (and b13, b2), nothing copied (``row_views``)."""
        rows = self.rows_of(experts)
        if -1 in rows:
            raise ValueError(f"ExpertWeights.local: experts {experts.start}..{experts.stop - 1} include "
                             f"slots not stored here (slot_rows {rows})")
        return LocalExperts(*(row_views(t, rows) for t in (self.w13, self.w2, *self.biases)))

    def gathered(self, experts: slice | None = None) -> ExpertWeights:
        """The same layer with one row per expert, copied from its slot row by a
        differentiable gather (gradients sum into the rows read); with ``experts``, only
        those are filled and the others are left unfilled (a path reading only those)."""
        if self.slot_rows is None:
            return self
        index = torch.tensor(self.slot_rows, device=self.w13.device)
        if -1 in self.slot_rows[experts or slice(None)]:
            raise ValueError(f"ExpertWeights.gathered: experts {experts} include slots not stored here "
                             f"(slot_rows -1)")
        if experts is None:  # autograd's own gather (torch.compile traces it)
            def gather(t: torch.Tensor) -> torch.Tensor:
                return t.index_select(0, index)
        else:
            def gather(t: torch.Tensor) -> torch.Tensor:
                return _RowGather.apply(t, index[experts], experts.start, self.spec.experts)
        return ExpertWeights.routed(self.spec, gather(self.w13), gather(self.w2), self.shared_w13,
                                    self.shared_w2, *(gather(b) for b in self.biases),
                                    shared_parts=self.shared_parts)

    @property
    def has_shared(self) -> bool:
        return self.shared_w13 is not None

    @property
    def biases(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[()]:
        """(b13, b2), or () without expert biases."""
        return (self.b13, self.b2) if self.b13 is not None else ()

    @staticmethod
    def routed(spec: MoESpec, w13: torch.Tensor, w2: torch.Tensor, shared_w13: torch.Tensor | None = None,
               shared_w2: torch.Tensor | None = None, b13: torch.Tensor | None = None,
               b2: torch.Tensor | None = None, slot_rows: tuple[int, ...] | None = None,
               shared_parts: tuple[torch.Tensor, torch.Tensor] | None = None,
               checked: bool = False) -> ExpertWeights:
        """The region's weights once routing is done (a region never reads the router):
        router and bias are zero placeholders that allocate nothing.  ``checked``: the
        tensors are (detached views of) those of an ``ExpertWeights`` of ``spec`` checked
        already, so they are not checked again (a call's host time)."""
        values = (spec, *router_placeholders(spec.experts, spec.hidden, w13.device), w13, w2,
                  shared_w13, shared_w2, b13, b2, slot_rows, shared_parts)
        if not checked:
            return ExpertWeights(*values)
        return _unchecked(dict(zip(_FIELDS, values, strict=True)))

    def detached(self) -> ExpertWeights:
        """The same weights detached from autograd, not checked again (they were), without
        ``shared_parts`` (a path computes on the fused tensor)."""
        if self.shared_parts is None and not any(isinstance(v, torch.Tensor) and v.requires_grad
                                                  for v in self.__dict__.values()):
            return self  # detached already (a layer's cached weights of calls without gradients)
        fields = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        return _unchecked({**fields, "shared_parts": None})

    def with_shared_w13(self, shared_w13: torch.Tensor) -> ExpertWeights:
        """These weights with ``shared_w13`` in place of theirs (the same shape and dtype:
        not checked again)."""
        return _unchecked({**self.__dict__, "shared_w13": shared_w13})

    @staticmethod
    def gate_only(spec: MoESpec, router: torch.Tensor, router_bias: torch.Tensor) -> ExpertWeights:
        """The router of a layer whose expert tensors the caller does not read (routing):
        every expert tensor a zero placeholder that allocates nothing."""
        zero = placeholder(spec.dtype, router.device)
        fs, e, f, h = spec.shared_ffn, spec.experts, spec.ffn, spec.hidden
        shared = (zero.expand(2 * fs, h), zero.expand(h, fs)) if fs else (None, None)
        biases = (zero.expand(e, 2 * f), zero.expand(e, h)) if spec.expert_bias else (None, None)
        return ExpertWeights(spec, router, router_bias, zero.expand(e, 2 * f, h), zero.expand(e, h, f),
                             *shared, *biases)

    @staticmethod
    def random(spec: MoESpec, seed: int = 0, device: torch.device | str = "cpu") -> ExpertWeights:
        """Weights drawn like a freshly initialised model (std 1/sqrt(fan_in)) on the CPU,
        so the same values on any ``device``, and placed there; on the meta device their
        shapes alone (nothing drawn: a layer too large for host memory is built so)."""
        g, device = torch.Generator().manual_seed(seed), torch.device(device)
        meta = device.type == "meta"

        def draw(*shape: int, fan_in: int | None, dtype: torch.dtype = spec.dtype) -> torch.Tensor:
            """std 1/sqrt(fan_in); None: std 0.01."""
            if meta:
                return torch.empty(*shape, dtype=dtype, device=device)
            drawn = torch.randn(*shape, generator=g, dtype=torch.float32, device="cpu")
            drawn = drawn * 0.01 if fan_in is None else drawn / fan_in**0.5
            return drawn.to(dtype=dtype, device=device)

        fs = spec.shared_ffn
        # float32 whatever the default dtype
        bias = torch.zeros(spec.experts, dtype=torch.float32, device=device)
        if spec.gate is GateKind.SIGMOID:
            bias = draw(spec.experts, fan_in=None, dtype=torch.float32)
        return ExpertWeights(
            spec=spec,
            router=draw(spec.experts, spec.hidden, fan_in=spec.hidden, dtype=torch.float32),
            router_bias=bias,
            w13=draw(spec.experts, 2 * spec.ffn, spec.hidden, fan_in=spec.hidden),
            w2=draw(spec.experts, spec.hidden, spec.ffn, fan_in=spec.ffn),
            shared_w13=draw(2 * fs, spec.hidden, fan_in=spec.hidden) if fs else None,
            shared_w2=draw(spec.hidden, fs, fan_in=fs) if fs else None,
            b13=draw(spec.experts, 2 * spec.ffn, fan_in=spec.hidden) if spec.expert_bias else None,
            b2=draw(spec.experts, spec.hidden, fan_in=spec.ffn) if spec.expert_bias else None,
        )


def _unchecked(fields: dict[str, object]) -> ExpertWeights:
    """An ``ExpertWeights`` of ``fields`` without ``__post_init__``'s checks."""
    out = object.__new__(ExpertWeights)
    out.__dict__.update(fields)
    return out


@dataclass(frozen=True)
class LocalExperts:
    """The expert tensors one (virtual) rank's experts read, indexed by its expert:
    w13 [L][2F, H], w2 [L][H, F], b13 [L][2F] and b2 [L][H] (None without biases)."""

    w13: Rows
    w2: Rows
    b13: Rows | None = None
    b2: Rows | None = None


def row_views(t: torch.Tensor, rows: Sequence[int]) -> Rows:
    """Rows ``rows`` of ``t`` [R, ...] indexed by position, nothing copied: the slice
    [len(rows), ...] where they are consecutive, else a tuple of row views."""
    rows = tuple(rows)
    lo = rows[0] if rows else 0
    if rows == tuple(range(lo, lo + len(rows))):
        return t[lo:lo + len(rows)]
    return tuple(t[r] for r in rows)


def rows_shape(rows: Rows) -> tuple[int, ...]:
    """The shape of ``rows`` as one [L, ...] tensor."""
    if isinstance(rows, torch.Tensor):
        return tuple(rows.shape)
    return (len(rows), *(rows[0].shape if rows else ()))


def slot_targets(rows: Sequence[int], stored: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where the gradients of slots reading stored rows ``rows`` (of ``stored``) go, in
    slot order: (each slot's target — its stored row for the first slot reading it, else
    scratch row ``stored + j`` — and the stored row of each scratch row j)."""
    seen, target, extra = set(), [], []
    for r in rows:
        target.append(stored + len(extra) if r in seen else r)
        if r in seen:
            extra.append(r)
        seen.add(r)
    return tuple(target), tuple(extra)


@dataclass(frozen=True)
class SlotGradients:
    """The expert weight gradients of a region computing slots ``first ..`` (one per
    ``target``) of weights whose experts read rows in place (``ExpertWeights.slot_rows``;
    without them every expert its own row), written where they belong.  The first of
    those slots reading a stored row writes its gradient straight into that row; a later
    one (another replica of the expert computed by the same region) writes into a
    scratch row, which ``fold`` adds to the stored row after the region, in slot order:
    the bits of ``gathered``'s backward (each slot's gradient ``index_add_``-ed into
    zeros, slot by slot).  Nothing else is copied.

    full: ``GRADIENT_FIELDS`` name -> [R, ...] gradient shaped like the stored tensor
    (w13, w2, b13, b2; biases where present); scratch: name -> [X, ...], one row per
    later replica; target: each slot's row, of ``full`` (< R) or of ``scratch`` (R + j);
    extra: the stored row each scratch row folds into."""

    full: dict[str, torch.Tensor]
    scratch: dict[str, torch.Tensor]
    first: int
    target: tuple[int, ...]
    extra: tuple[int, ...]

    @staticmethod
    def of(weights: ExpertWeights, slots: slice, fill: float | None = 0.0) -> SlotGradients:
        """Gradients for a region computing ``slots`` of ``weights``, every element
        ``fill`` (0: experts without rows get no task and keep zeros; None: left
        uninitialised, for a region whose tasks write every row they own, followed by
        ``zero_idle``)."""
        computed = range(weights.spec.experts)[slots]
        rows = weights.rows_of(slice(computed.start, computed.stop))
        if -1 in rows:
            raise ValueError(f"SlotGradients: slots {computed.start}..{computed.stop - 1} include slots not "
                             f"stored here (slot_rows {rows})")
        target, extra = slot_targets(rows, weights.w13.shape[0])
        tensors = dict(zip(GRADIENT_FIELDS, (weights.w13, weights.w2, *weights.biases), strict=False))
        shape = {n: (len(extra), *t.shape[1:]) for n, t in tensors.items()}
        if fill is None:
            full = {n: torch.empty_like(t) for n, t in tensors.items()}
            scratch = {n: t.new_empty(shape[n]) for n, t in tensors.items()}
        else:
            full = {n: torch.full_like(t, fill) for n, t in tensors.items()}
            scratch = {n: t.new_full(shape[n], fill) for n, t in tensors.items()}
        return SlotGradients(full, scratch, computed.start, target, extra)

    @property
    def stored(self) -> int:
        """R: rows of the stored tensors."""
        return self.full["dw13"].shape[0]

    def views(self, slots: slice) -> dict[str, Rows]:
        """Where ``slots`` (some of the region's) write their gradients, keyed by
        ``GRADIENT_FIELDS`` name, indexed by slot from ``slots.start`` (``row_views``)."""
        target, r = self.target[slots.start - self.first:slots.stop - self.first], self.stored
        if all(t < r for t in target):
            return {n: row_views(g, target) for n, g in self.full.items()}
        return {n: tuple(g[t] if t < r else self.scratch[n][t - r] for t in target)
                for n, g in self.full.items()}

    def zero_idle(self, active: Sequence[bool]) -> None:
        """Zero what no task wrote (gradients uninitialised or filled with NaN): the rows of computed
        slots that received no rows (``active``: per computed slot) and the stored rows
        no computed slot reads."""
        r = self.stored
        idle = [t for t, busy in zip(self.target, active, strict=True) if not busy]
        unread = sorted(set(range(r)) - {t for t in self.target if t < r})
        for n, g in self.full.items():
            rows = [t for t in idle if t < r] + unread
            g.index_fill_(0, torch.tensor(rows, dtype=torch.int64, device=g.device), 0)
            spare = [t - r for t in idle if t >= r]
            self.scratch[n].index_fill_(0, torch.tensor(spare, dtype=torch.int64, device=g.device), 0)

    def fold(self) -> None:
        """Add each scratch row into its stored row after the region, in slot order, as
        ``index_add_`` does on a CPU (narrower dtypes than fp32: summed in fp32, rounded
        once)."""
        for n, scratch in self.scratch.items():
            full = self.full[n]
            for row in dict.fromkeys(self.extra):
                acc = full[row].to(torch.promote_types(full.dtype, torch.float32))  # fp32: the row itself
                for j in (j for j, r in enumerate(self.extra) if r == row):
                    acc += scratch[j]
                if acc.dtype != full.dtype:
                    full[row] = acc


def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d zero of ``dtype`` on ``device``, made once: its expansions stand for tensors
    a caller never reads (no memory, no kernel a call); a fresh one inside a compiled
    graph (which holds no tensor made outside it)."""
    if torch.compiler.is_compiling():
        return torch.zeros((), dtype=dtype, device=device)
    return _placeholder(dtype, torch.device(device))


@functools.cache
def _placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # made in inference mode, it is saved for a backward after
        return torch.zeros((), dtype=dtype, device=device)


def router_placeholders(experts: int, hidden: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(router [E, H], score-correction bias [E]) float32 placeholders (``placeholder``'s
    expansions), made once per shape and device."""
    if torch.compiler.is_compiling():
        zero = placeholder(torch.float32, device)
        return zero.expand(experts, hidden), zero.expand(experts)
    return _router_placeholders(experts, hidden, torch.device(device))


@functools.cache
def _router_placeholders(experts: int, hidden: int,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    zero = _placeholder(torch.float32, device)
    return zero.expand(experts, hidden), zero.expand(experts)  # views of a normal tensor stay normal


class _RowGather(torch.autograd.Function):
    """[experts, ...] whose rows ``first + i`` are ``t[index[i]]`` (the rest unfilled);
    backward: the gradient of those rows summed into ``t``'s (the other rows' gradient
    is zero: no path reads them)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, index: torch.Tensor, first: int, experts: int) -> torch.Tensor:
        ctx.index, ctx.first, ctx.rows = index, first, t.shape[0]
        out = t.new_empty((experts, *t.shape[1:]))
        torch.index_select(t, 0, index, out=out[first:first + index.numel()])
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        n = ctx.index.numel()
        grad = g.new_zeros((ctx.rows, *g.shape[1:]))
        return grad.index_add_(0, ctx.index, g[ctx.first:ctx.first + n]), None, None, None


_FIELDS = tuple(f.name for f in fields(ExpertWeights))


def _check_tensor(name: str, tensor: object, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
    if tensor.dtype != dtype:
        raise TypeError(f"{name} has dtype {tensor.dtype}, expected {dtype}")

"""Expert weights of one MoE layer, in the layout transformers uses.

Routed experts are stored fused, as in transformers' ``DeepseekV3Experts`` and
``Qwen3MoeExperts``: ``w13[e]`` is ``[2F, H]`` with the gate projection in rows
``[0, F)`` and the up projection in rows ``[F, 2F)``; ``w2[e]`` is ``[H, F]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import GateKind, MoESpec


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
                                    self.shared_w2, *(gather(b) for b in self.biases))

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
               b2: torch.Tensor | None = None, slot_rows: tuple[int, ...] | None = None) -> ExpertWeights:
        """The region's weights once routing is done (a region never reads the router):
        router and bias are zero placeholders that allocate nothing."""
        zero = torch.zeros((), dtype=torch.float32, device=w13.device)
        return ExpertWeights(spec, zero.expand(spec.experts, spec.hidden), zero.expand(spec.experts), w13, w2,
                             shared_w13, shared_w2, b13, b2, slot_rows)

    @staticmethod
    def gate_only(spec: MoESpec, router: torch.Tensor, router_bias: torch.Tensor) -> ExpertWeights:
        """The router of a layer whose expert tensors the caller does not read (routing):
        every expert tensor a zero placeholder that allocates nothing."""
        zero = torch.zeros((), dtype=spec.dtype, device=router.device)
        fs, e, f, h = spec.shared_ffn, spec.experts, spec.ffn, spec.hidden
        shared = (zero.expand(2 * fs, h), zero.expand(h, fs)) if fs else (None, None)
        biases = (zero.expand(e, 2 * f), zero.expand(e, h)) if spec.expert_bias else (None, None)
        return ExpertWeights(spec, router, router_bias, zero.expand(e, 2 * f, h), zero.expand(e, h, f),
                             *shared, *biases)

    @staticmethod
    def random(spec: MoESpec, seed: int = 0) -> ExpertWeights:
        """Weights drawn like a freshly initialised model (std 1/sqrt(fan_in))."""
        g = torch.Generator().manual_seed(seed)

        def draw(*shape: int, fan_in: int, dtype: torch.dtype = spec.dtype) -> torch.Tensor:
            drawn = torch.randn(*shape, generator=g, dtype=torch.float32, device="cpu")
            return (drawn / fan_in**0.5).to(dtype)

        fs = spec.shared_ffn
        # float32 whatever the default dtype
        bias = torch.zeros(spec.experts, dtype=torch.float32, device="cpu")
        if spec.gate is GateKind.SIGMOID:
            bias = torch.randn(spec.experts, generator=g, dtype=torch.float32, device="cpu") * 0.01
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


def _check_tensor(name: str, tensor: object, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
    if tensor.dtype != dtype:
        raise TypeError(f"{name} has dtype {tensor.dtype}, expected {dtype}")

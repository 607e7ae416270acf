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

    def __post_init__(self) -> None:
        s = self.spec
        fs = s.shared_ffn
        expected = {
            "router": (self.router, (s.experts, s.hidden), torch.float32),
            "router_bias": (self.router_bias, (s.experts,), torch.float32),
            "w13": (self.w13, (s.experts, 2 * s.ffn, s.hidden), s.dtype),
            "w2": (self.w2, (s.experts, s.hidden, s.ffn), s.dtype),
        }
        if fs:
            expected["shared_w13"] = (self.shared_w13, (2 * fs, s.hidden), s.dtype)
            expected["shared_w2"] = (self.shared_w2, (s.hidden, fs), s.dtype)
        elif self.shared_w13 is not None or self.shared_w2 is not None:
            raise ValueError("ExpertWeights.shared_w13/shared_w2 given but spec.shared_experts=0")
        if s.expert_bias:
            expected["b13"] = (self.b13, (s.experts, 2 * s.ffn), s.dtype)
            expected["b2"] = (self.b2, (s.experts, s.hidden), s.dtype)
        elif self.b13 is not None or self.b2 is not None:
            raise ValueError("ExpertWeights.b13/b2 given but spec.expert_bias=False")
        for name, (tensor, shape, dtype) in expected.items():
            _check_tensor(f"ExpertWeights.{name}", tensor, shape, dtype)

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
               b2: torch.Tensor | None = None) -> ExpertWeights:
        """The region's weights once routing is done (a region never reads the router):
        router and bias are zero placeholders that allocate nothing."""
        zero = torch.zeros((), dtype=torch.float32, device=w13.device)
        return ExpertWeights(spec, zero.expand(spec.experts, spec.hidden), zero.expand(spec.experts), w13, w2,
                             shared_w13, shared_w2, b13, b2)

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



def _check_tensor(name: str, tensor: object, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
    if tensor.dtype != dtype:
        raise TypeError(f"{name} has dtype {tensor.dtype}, expected {dtype}")

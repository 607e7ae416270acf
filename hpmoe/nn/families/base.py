"""What hpmoe needs to know about one transformers MoE block family.

Every supported block (transformers 5.x) is ``router`` -> ``experts`` (+ shared experts):
the router module returns ``(router_logits, top_k_weights [N, k], top_k_index [N, k])`` and
the experts module holds ``gate_up_proj`` [E, 2F, H] (gate rows first) and ``down_proj``
[E, H, F] with an ``act_fn``.  hpmoe calls the block's own router module exactly as the
block does (so output-capturing hooks, ``output_router_logits`` and the auxiliary loss see
the same logits) and replaces only what follows: the experts, and a plain shared MLP
inside the region.  A ``Family`` names the attributes; ``refused`` says why a family whose
maths the region does not compute is refused.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...spec import Activation


@dataclass(frozen=True)
class Family:
    """One transformers MoE block family.

    name: the transformers ``model_type``.  module / block: where the block class lives.
    router: attribute of the router module, called as ``router(x [N, H])``.
    shared: attribute of an ungated shared MLP (``gate_proj``/``up_proj``/``down_proj``),
      added to every token; fused into the region when its maths fits, else run beside it.
    shared_gate: attribute of a ``Linear(H, 1)`` whose sigmoid scales ``shared`` per token
      (Qwen2-MoE, Qwen3-Next); such a shared expert runs beside the region.
    jitter: block attribute holding the training-time input jitter amplitude (Mixtral).
    router_args: block attributes passed to the router after ``x`` (MiniMax-M2: the
      block's score-correction bias buffer).
    refused: None, or the feature of the block that the region does not compute.
    config / model: transformers class names of the family's config and causal LM.
    tiny: overrides that make ``config`` a tiny test model (no download).
    """

    name: str
    module: str
    block: str
    config: str
    model: str
    tiny: dict[str, Any]
    router: str = "gate"
    shared: str | None = None
    shared_gate: str | None = None
    jitter: str | None = None
    router_args: tuple[str, ...] = ()
    refused: str | None = None

    def block_class(self) -> type[nn.Module]:
        return getattr(importlib.import_module(self.module), self.block)

    def tiny_config(self, **overrides: Any) -> Any:
        """A tiny config of this family (H 32, F 16, 8 experts, top-2, 2 layers)."""
        import transformers

        return getattr(transformers, self.config)(**{**TINY, **self.tiny, **overrides})

    def tiny_model(self, seed: int = 0, **overrides: Any) -> nn.Module:
        """A randomly initialised tiny causal LM of this family (``torch.manual_seed(seed)``)."""
        import torch
        import transformers

        torch.manual_seed(seed)
        return getattr(transformers, self.model)(self.tiny_config(**overrides))


TINY: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=16,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,  # special tokens inside the 64-token vocabulary (some defaults are not)
    bos_token_id=None,
    eos_token_id=None,
)


def activation_of(act: nn.Module) -> Activation:
    """The ``Activation`` a transformers ``ACT2FN`` module computes; ``ValueError`` naming
    the class when the region has no kernel for it."""
    kind = type(act).__name__
    if kind in ("SiLUActivation", "SiLU"):
        return Activation.SILU
    if kind == "GELUActivation":
        return Activation.GELU
    if kind in ("GELUTanh", "NewGELUActivation", "FastGELUActivation", "PytorchGELUTanh"):
        return Activation.GELU_TANH
    if kind == "ReLU":
        return Activation.RELU
    raise ValueError(
        f"expert activation {kind} is not supported; hpmoe computes {sorted(a.value for a in Activation)}"
    )


def check_flags(experts: nn.Module, owner: str) -> None:
    """``ValueError`` (naming ``owner``) for experts with biases, transposed weights or
    interleaved gate/up columns: the region reads gate_up_proj [E, 2F, H], gate rows first."""
    for flag, bad in (("has_bias", True), ("is_transposed", True), ("is_concatenated", False)):
        if getattr(experts, flag, not bad) is bad:
            raise ValueError(f"{owner}: experts.{flag}={bad} is not supported")


Reader = Callable[[nn.Module], Any]
